"""Bucketed shared-memory allreduce, started bucket by bucket while backward runs.

PyTorch DDP's Reducer (``torch/csrc/distributed/c10d/reducer.cpp``) groups parameters,
in reverse registration order (roughly the order backward produces them), into buckets
of at most ``bucket_cap_mb`` (25 MiB; the first bucket 1 MiB so communication starts
early); an autograd hook marks each gradient ready, and when a bucket is complete its
allreduce is launched asynchronously, buckets strictly in order so every rank issues
the same sequence. This module is that machinery's communication half over the host's
shared memory (the hooks live in :mod:`shmtrain.strategies.ssgd_overlap`).

Each worker writes a bucket's gradients into its own slot (one flat slot per worker,
two sets alternating by step parity, as in :mod:`shmtrain.fabric.shm_allreduce`).
A communication thread per worker takes launched buckets in order and, for bucket ``b``
of step ``k`` (sequence number ``s = (k - 1) * B + b + 1``): posts "arrived" = ``s``,
sleeps until every local rank has posted ``s``, reduces its chunk of the bucket (local
rank ``r`` owns the r-th of ``L`` slices, PAR-SUM) from all slots into the shared
result, and posts "reduced" = ``s``. Sequence words grow monotonically, so "every rank
posted ``k * B``" means every bucket of step ``k`` is reduced. Across hosts, local
rank 0 allreduces each reduced bucket with the other hosts' leaders (gloo) and posts
"published". The torch ops and the futex waits release the GIL, so the thread runs
beside backward.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist

from shmtrain.fabric.control import PeerTimeout
from shmtrain.fabric.host import HostGroup
from shmtrain.fabric.segment import align
from shmtrain.fabric.shm_allreduce import split
from shmtrain.fabric.stitch import PAGE

FIRST_BUCKET_BYTES = 1 << 20  # DDP's kDefaultFirstBucketBytes


def assign_buckets(sizes: Sequence[int], cap_bytes: int, first_cap_bytes: int = FIRST_BUCKET_BYTES) -> list[range]:
    """Split tensors (byte ``sizes``, in bucket order) into consecutive groups of at most
    ``cap_bytes`` (the first at most ``min(first_cap_bytes, cap_bytes)``); a tensor larger
    than the cap gets a bucket of its own. Returns tensor index ranges."""
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    buckets: list[range] = []
    start, filled = 0, 0
    cap = min(first_cap_bytes, cap_bytes)
    for i, size in enumerate(sizes):
        if i > start and filled + size > cap:
            buckets.append(range(start, i))
            start, filled, cap = i, 0, cap_bytes
        filled += size
    if start < len(sizes):
        buckets.append(range(start, len(sizes)))
    return buckets


class BucketAllreduce:
    """Average (or sum) a flat buffer over every worker, one bucket at a time.

    Args:
        host: the host's workers.
        numel: elements of the flat buffer.
        buckets: element ranges ``(lo, hi)`` covering the buffer, in launch order.
        dtype: element type.
        op: ``"mean"`` over all workers of the job, or ``"sum"``.
        leaders: gloo group of every host's local rank 0; None on one host.
        tag: name fragment of the segment and channels.
    """

    def __init__(
        self,
        host: HostGroup,
        numel: int,
        buckets: Sequence[tuple[int, int]],
        *,
        dtype: torch.dtype = torch.float32,
        op: Literal["mean", "sum"] = "mean",
        leaders: dist.ProcessGroup | None = None,
        tag: str = "buckets",
    ) -> None:
        if op not in ("mean", "sum"):
            raise ValueError(f"op {op!r} must be 'mean' or 'sum'")
        self.host = host
        self.numel = numel
        self.buckets = [tuple(b) for b in buckets]
        self.op = op
        self.leaders = leaders
        self.num_hosts = dist.get_world_size(leaders) if leaders is not None else 1
        L = host.local_world
        itemsize = torch.empty((), dtype=dtype).element_size()
        stride = align(max(numel, 1) * itemsize, PAGE)
        self.segment = host.allocate(tag, stride * (L + 1) * 2)
        self.slots = [[self.segment.tensor(dtype, ((L + 1) * s + r) * stride, numel) for r in range(L)]
                      for s in (0, 1)]
        self.results = [self.segment.tensor(dtype, ((L + 1) * s + L) * stride, numel) for s in (0, 1)]
        self._chunks = [
            [(lo + a, lo + b) for a, b in split(hi - lo, L)][host.local_rank] for lo, hi in self.buckets
        ]
        self._arrived = host.channel(f"{tag}.arrived")
        self._reduced = host.channel(f"{tag}.reduced")
        self._published = host.channel(f"{tag}.published")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._done = 0  # sequence number of the last bucket this worker finished
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="shmtrain-buckets", daemon=True)
        self._thread.start()

    def input(self, step: int) -> torch.Tensor:
        """This worker's slot for ``step``: write the gradients here before launching."""
        return self.slots[step % 2][self.host.local_rank]

    def result(self, step: int) -> torch.Tensor:
        """The shared reduced buffer of ``step`` (valid until this worker's step + 1 ends)."""
        return self.results[step % 2]

    def launch(self, bucket: int, step: int) -> None:
        """Start bucket ``bucket`` of ``step``; call in bucket order, every bucket, every step."""
        self._queue.put((bucket, step))

    def wait(self, step: int) -> None:
        """Sleep until every bucket of ``step`` is reduced on every worker of the job."""
        target = step * len(self.buckets)
        deadline = time.monotonic() + self.host.timeout + 5.0  # the thread times out first
        with self._cond:
            while self._done < target and self._error is None:
                if not self._thread.is_alive():
                    raise RuntimeError("the bucket allreduce thread has stopped")
                if time.monotonic() > deadline:
                    raise PeerTimeout(f"bucket allreduce of step {step} did not finish within {self.host.timeout:.0f} s")
                self._cond.wait(0.05)
        if self._error is not None:
            raise self._error
        control = self.host.control
        if self.leaders is None:
            control.wait(self._reduced, self.host.ranks, target, timeout=self.host.timeout, what="bucket reduction")
        elif self.host.local_rank != 0:
            control.wait(self._published, [0], target, timeout=self.host.timeout, what="hosts' buckets")

    def close(self) -> None:
        """Stop the communication thread (after the last :meth:`wait`)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=self.host.timeout)

    # -- the communication thread -------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    return
                bucket, step = item
                self._reduce(bucket, step)
                with self._cond:
                    self._done = (step - 1) * len(self.buckets) + bucket + 1
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _reduce(self, bucket: int, step: int) -> None:
        host, control = self.host, self.host.control
        seq = (step - 1) * len(self.buckets) + bucket + 1
        me = host.local_rank
        control.post(self._arrived, me, seq)
        control.wait(self._arrived, host.ranks, seq, timeout=host.timeout, what=f"bucket {bucket} gradients")
        lo, hi = self._chunks[bucket]
        slots, out = self.slots[step % 2], self.results[step % 2][lo:hi]
        if hi > lo:
            if len(slots) == 1:
                out.copy_(slots[0][lo:hi])
            else:
                torch.add(slots[0][lo:hi], slots[1][lo:hi], out=out)
                for slot in slots[2:]:
                    out.add_(slot[lo:hi])
                if self.op == "mean" and self.leaders is None:
                    out.mul_(1.0 / len(slots))
        control.post(self._reduced, me, seq)
        if self.leaders is not None and me == 0:
            control.wait(self._reduced, host.ranks, seq, timeout=host.timeout, what=f"bucket {bucket} reduction")
            blo, bhi = self.buckets[bucket]
            view = self.results[step % 2][blo:bhi]
            dist.all_reduce(view, group=self.leaders)
            if self.op == "mean":
                view.mul_(1.0 / (len(slots) * self.num_hosts))
            control.post(self._published, me, seq)
