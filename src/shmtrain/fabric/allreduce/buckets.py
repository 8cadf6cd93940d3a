"""Bucketed shared-memory allreduce, started bucket by bucket while backward runs.

PyTorch DDP's Reducer (``torch/csrc/distributed/c10d/reducer.cpp``) groups parameters,
in reverse registration order (roughly the order backward produces them), into buckets
of at most ``bucket_cap_mb`` (25 MiB; the first bucket 1 MiB so communication starts
early); an autograd hook marks each gradient ready, and when a bucket is complete its
allreduce is launched asynchronously, buckets strictly in order so every rank issues
the same sequence. This module is that machinery's communication half over the host's
shared memory (the hooks live in :mod:`shmtrain.strategies.ssgd.overlap`).

Each worker writes a bucket's gradients into its own slot (one flat slot per worker)
and the reduced buckets go to one shared result. One set of each is enough, unlike
:mod:`shmtrain.fabric.allreduce.shared` (which reduces in place and needs two sets by step
parity): a worker writes its slot for step ``k + 1`` only after every chunk of step ``k``
was reduced (its :meth:`BucketAllreduce.wait` saw that), and a chunk of the result is
overwritten for step ``k + 1`` only after every worker posted its bucket of step
``k + 1``, i.e. finished reading the result of step ``k`` in its optimizer. One set also
halves the memory the gradients stream through each iteration.
Bucket ``b`` of step ``k`` has the sequence number ``s = (k - 1) * B + b + 1``.
:meth:`BucketAllreduce.launch` posts "arrived" = ``s`` and makes progress: for every
launched bucket, in order, whose inputs have arrived from every local rank, local rank
``r`` reduces the r-th of ``L`` slices of the bucket (PAR-SUM) from all slots into the
shared result and posts "reduced" = ``s``. Progress never blocks during backward: a
bucket whose peers are late is reduced at a later launch, or in :meth:`wait` after
backward, which sleeps for what is left. Sequence words grow monotonically, so "every
rank posted ``k * B``" means every bucket of step ``k`` is reduced. Across hosts, local
rank 0 starts a gloo allreduce (``async_op``) of each bucket reduced by every local rank
and, in :meth:`wait`, waits for them and posts "published".

Progress runs on the training thread, inside the gradient hooks, not on a communication
thread: with one compute thread per core (2 workers on 2 cores here) a thread only takes
time slices from backward and moves every bucket to another core's cache, while in the
hook the gradients it reduces were just written. Measured with ``shmtrain bench overlap``
(docs/overlap.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist

from shmtrain.fabric.allreduce.shared import split
from shmtrain.fabric.job.hierarchy import Hierarchy
from shmtrain.fabric.shm.host import HostGroup
from shmtrain.fabric.shm.segment import align
from shmtrain.fabric.shm.stitch import PAGE

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
        L = host.local_world
        itemsize = torch.empty((), dtype=dtype).element_size()
        stride = align(max(numel, 1) * itemsize, PAGE)
        self.segment = host.allocate(tag, stride * (L + 1))
        self.slots = [self.segment.tensor(dtype, r * stride, numel) for r in range(L)]
        self.result_buffer = self.segment.tensor(dtype, L * stride, numel)
        self._chunks = [
            [(lo + a, lo + b) for a, b in split(hi - lo, L)][host.local_rank] for lo, hi in self.buckets
        ]
        self._arrived = host.channel(f"{tag}.arrived")
        self._reduced = host.channel(f"{tag}.reduced")
        self.hierarchy = Hierarchy(host, leaders, tag=tag)
        self.num_hosts = self.hierarchy.hosts
        self._B = len(self.buckets)
        self._launched = 0  # sequence number of the last bucket this worker launched
        self._done = 0  # ... whose chunk this worker reduced
        self._sent = 0  # ... started between hosts (local rank 0 of a multi-host job)
        self._works: list[tuple[torch.Tensor, dist.Work]] = []

    def input(self) -> torch.Tensor:
        """This worker's slot (the same every step): write the gradients here before
        launching; free again once :meth:`wait` of the step returned."""
        return self.slots[self.host.local_rank]

    def result(self) -> torch.Tensor:
        """The shared reduced buffer (the same every step): valid after :meth:`wait` of a
        step until this worker launches the first bucket of the next step."""
        return self.result_buffer

    def launch(self, bucket: int, step: int) -> None:
        """Start bucket ``bucket`` of ``step``; call in bucket order, every bucket, every step."""
        seq = (step - 1) * self._B + bucket + 1
        if seq != self._launched + 1:
            raise RuntimeError(f"bucket {bucket} of step {step} launched out of order "
                               f"(expected sequence {self._launched + 1}, got {seq})")
        self._launched = seq
        self.host.control.post(self._arrived, self.host.local_rank, seq)
        self.progress()

    def progress(self, block: bool = False) -> None:
        """Reduce this worker's chunk of every launched bucket whose inputs arrived, in
        order; stop at the first one still waiting for a peer unless ``block``."""
        while self._done < self._launched and self._ready(self._arrived, self._done + 1, block, "gradients"):
            self._reduce(self._done + 1)
            self._done += 1
            self.host.control.post(self._reduced, self.host.local_rank, self._done)
        if self.leaders is not None and self.host.local_rank == 0:
            while self._sent < self._done and self._ready(self._reduced, self._sent + 1, block, "reduction"):
                self._sent += 1
                lo, hi = self.buckets[(self._sent - 1) % self._B]
                view = self.result_buffer[lo:hi]
                self._works.append((view, self.hierarchy.start_allreduce(view)))

    def reduced(self, bucket: int, step: int) -> bool:
        """Whether bucket ``bucket`` of ``step`` is final in :meth:`result` (never blocks):
        every local rank reduced its chunk, in a one-host job; False across hosts (the
        mean lands in :meth:`wait`)."""
        seq = (step - 1) * self._B + bucket + 1
        return self.leaders is None and seq <= self._launched and self._ready(self._reduced, seq, False, "")

    def wait(self, step: int) -> None:
        """Finish every bucket of ``step`` (all launched) and sleep until every worker of
        the job holds the result."""
        target = step * self._B
        if self._launched < target:
            raise RuntimeError(f"wait for step {step} before all its {self._B} buckets were launched")
        self.progress(block=True)
        host, control = self.host, self.host.control
        self.hierarchy.finish(
            target, what="hosts' buckets", across=self._finish_across,
            local=lambda: control.wait(self._reduced, host.ranks, target, timeout=host.timeout,
                                       what="bucket reduction"))

    def _finish_across(self) -> None:
        """Leader: wait for the buckets' sums among the leaders; scale them to the mean."""
        for view, work in self._works:
            work.wait()
            if self.op == "mean":
                view.mul_(1.0 / (self.host.local_world * self.num_hosts))
        self._works.clear()

    def close(self) -> None:
        """Nothing runs in the background; kept so callers release it like the others."""
        self._works.clear()

    def _ready(self, channel: int, seq: int, block: bool, what: str) -> bool:
        """Has every local rank posted ``seq`` on ``channel``? With ``block``, sleep until
        it has (errors name a dead or late peer)."""
        host, control = self.host, self.host.control
        if block:
            control.wait(channel, host.ranks, seq, timeout=host.timeout,
                         what=f"bucket {(seq - 1) % self._B} {what}")
            return True
        return all(control.get(channel, r) >= seq for r in host.ranks)

    def _reduce(self, seq: int) -> None:
        lo, hi = self._chunks[(seq - 1) % self._B]
        if hi <= lo:
            return
        slots, out = self.slots, self.result_buffer[lo:hi]
        mean = self.op == "mean" and self.leaders is None
        if len(slots) == 1:
            out.copy_(slots[0][lo:hi])
        elif len(slots) == 2 and mean:  # (a + b) / 2, rounded as DDP's mean is (a lerp is not)
            torch.add(slots[0][lo:hi], slots[1][lo:hi], out=out).mul_(0.5)
        else:
            torch.add(slots[0][lo:hi], slots[1][lo:hi], out=out)
            for slot in slots[2:]:
                out.add_(slot[lo:hi])
            if mean:
                out.mul_(1.0 / len(slots))


class GlooBucketAllreduce:
    """:class:`BucketAllreduce`'s interface over ``torch.distributed.all_reduce(async_op=True)``
    per bucket: exactly DDP's transport (``ssgd --overlap --allreduce gloo``).

    The input and the result are one private flat buffer, reduced in place.
    """

    def __init__(
        self,
        numel: int,
        buckets: Sequence[tuple[int, int]],
        *,
        dtype: torch.dtype = torch.float32,
        op: Literal["mean", "sum"] = "mean",
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.buckets = list(buckets)
        self.op = op
        self.group = group
        self._flat = torch.zeros(numel, dtype=dtype)
        self._works: list[dist.Work] = []

    def input(self) -> torch.Tensor:
        """The flat buffer the gradients are written into (reused every step)."""
        return self._flat

    def result(self) -> torch.Tensor:
        """The reduced buffer: the input itself (in place)."""
        return self._flat

    def launch(self, bucket: int, step: int) -> None:  # noqa: ARG002 - same interface
        """Start bucket ``bucket``'s allreduce (every rank launches the same sequence)."""
        if bucket == 0:
            self._works.clear()
        lo, hi = self.buckets[bucket]
        self._works.append(dist.all_reduce(self._flat[lo:hi], group=self.group, async_op=True))

    def progress(self, block: bool = False) -> None:
        """Nothing to do: gloo progresses on its own threads."""

    def reduced(self, bucket: int, step: int) -> bool:  # noqa: ARG002 - same interface
        """False: the mean is scaled in :meth:`wait`."""
        return False

    def wait(self, step: int) -> None:  # noqa: ARG002 - same interface
        """Wait for every launched bucket; scale to the mean."""
        for work in self._works:
            work.wait()
        self._works.clear()
        if self.op == "mean":
            self._flat.mul_(1.0 / dist.get_world_size(self.group))

    def close(self) -> None:
        """Drain anything still in flight (so no gloo work outlives the process group)."""
        for work in self._works:
            work.wait()
        self._works.clear()
