"""Shared-memory allreduce for the workers of one host (and hierarchical across hosts).

Zero copy in: gradients are produced straight into the worker's own slot (the model's
``.grad`` tensors are views of it). Split reduction (PAR-SUM, swCaffe Section V-A):
local rank ``r`` reduces chunk ``r`` of every slot *in place*, into chunk ``r`` of its
own slot. Zero copy out: every worker reads the whole result through a stitched view
(:mod:`shmtrain.fabric.shm.stitch`) that maps chunk ``j`` of slot ``j`` back to back. Per
element, memory traffic is ``L`` reads and one in-place write for ``L`` workers, against
``2L`` for an allreduce that reads every input and writes every private output.

For float32 the chunk is reduced by ``shm_sum_into_f32`` of ``pipeline_native.c`` where
it could be built (:mod:`shmtrain.fabric.native`): every peer added to a 16 KiB block of
the own chunk while that block is in the L1 cache, so the chunk crosses memory once
instead of once per peer, then scaled by ``1/L`` for a mean. With 4 ranks on 2 cores
a rank's 16 MiB reduction then takes about as long as merely reading its share of the
freshly written slots (docs/collectives.md). Elsewhere: torch ``add_``/``lerp_`` per peer.

Two sets of slots alternate by step parity: while a slow worker still reads the
result of step ``k`` (in set ``k % 2``), a fast one already zeroes and fills set
``(k + 1) % 2``. Set ``k % 2`` is reused at step ``k + 2`` only after everyone has
arrived at ``k + 1``, i.e. finished reading the result of ``k``.

Synchronisation: per rank, futex-backed sequence words "arrived" (my slot holds this
step's input) and "reduced" (my chunk holds this step's result); waiters sleep.

Across hosts (``leaders`` given): after the local reduction, local rank 0 of each host
allreduces the result with the other hosts' leaders over torch.distributed (gloo) and
publishes it; the other local ranks wait for it (reduce inside the host, allreduce among
leaders, result back inside the host: :class:`~shmtrain.fabric.job.hierarchy.Hierarchy`).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from shmtrain.fabric import native
from shmtrain.fabric.allreduce.pipeline import PipelinedAllreduce, split
from shmtrain.fabric.job.hierarchy import Hierarchy
from shmtrain.fabric.shm.host import HostGroup
from shmtrain.fabric.shm.segment import align
from shmtrain.fabric.shm.stitch import PAGE, StitchedView

BLOCK_ELEMENTS = 1 << 20  # apply every peer to one block while it is in cache
__all__ = ["BLOCK_ELEMENTS", "ShmAllreduce", "split"]


class ShmAllreduce:
    """Average or sum a flat buffer over every worker of the job.

    Args:
        host: the host's workers.
        numel: elements per buffer.
        dtype: element type.
        op: ``"mean"`` over all workers of the job, or ``"sum"``.
        leaders: gloo group of every host's local rank 0 (registered with torch.distributed
            or a bare ``ProcessGroupGloo``); None on one host.
        tag: name fragment of the segment.
    """

    def __init__(
        self,
        host: HostGroup,
        numel: int,
        *,
        dtype: torch.dtype = torch.float32,
        op: Literal["mean", "sum"] = "mean",
        leaders: dist.ProcessGroup | None = None,
        tag: str = "allreduce",
    ) -> None:
        if op not in ("mean", "sum"):
            raise ValueError(f"op {op!r} must be 'mean' or 'sum'")
        self.host = host
        self.numel = numel
        self.op = op
        self.leaders = leaders
        itemsize = torch.empty((), dtype=dtype).element_size()
        L = host.local_world
        self._stride = align(max(numel, 1) * itemsize, PAGE)
        self.segment = host.allocate(tag, self._stride * L * 2)
        self.chunks = split(numel, L, granule=PAGE // itemsize)
        self.slots = [
            [self.segment.tensor(dtype, (s * L + r) * self._stride, numel) for r in range(L)]
            for s in range(2)
        ]
        self._views = [
            StitchedView(
                self.segment,
                [((s * L + r) * self._stride + lo * itemsize, (hi - lo) * itemsize)
                 for r, (lo, hi) in enumerate(self.chunks)],
                dtype,
                numel,
            )
            for s in range(2)
        ]
        self.results = [view.tensor for view in self._views]
        self._arrived = host.channel(f"{tag}.arrived")
        self._reduced = host.channel(f"{tag}.reduced")
        self.hierarchy = Hierarchy(host, leaders, tag=tag)
        self.num_hosts = self.hierarchy.hosts
        self.count = 0
        self.tag = tag
        self._pipeline: PipelinedAllreduce | None = None

    def input(self, step: int | None = None) -> torch.Tensor:
        """This worker's slot for ``step`` (default: the next call): write the buffer here."""
        step = self.count + 1 if step is None else step
        return self.slots[step % 2][self.host.local_rank]

    def result(self, step: int | None = None) -> torch.Tensor:
        """The reduced buffer of ``step`` (default: the last call), a stitched view."""
        step = self.count if step is None else step
        return self.results[step % 2]

    def __call__(self) -> torch.Tensor:
        """Reduce every worker's slot of this step; return the shared result.

        The result stays valid until this worker's next call returns.
        """
        host, control = self.host, self.host.control
        me = host.local_rank
        self.count += 1
        step = self.count
        control.post(self._arrived, me, step)
        control.wait(self._arrived, host.ranks, step, timeout=host.timeout, what="gradients")
        self._reduce_chunk(self.slots[step % 2], *self.chunks[me])
        control.post(self._reduced, me, step)
        result = self.results[step % 2]
        scale = 1.0 / self.num_hosts if self.op == "mean" else None
        self.hierarchy.finish(
            step, what="hosts' result",
            local=lambda: control.wait(self._reduced, host.ranks, step, timeout=host.timeout, what="reduction"),
            across=lambda: self.hierarchy.allreduce(result, scale=scale))
        return result

    def reduce_private(self, tensor: torch.Tensor) -> torch.Tensor:
        """Allreduce a private tensor in place (what ``torch.distributed.all_reduce`` offers):
        copy in, reduce, copy the result back into ``tensor``; returns ``tensor``.

        ``tensor`` must be contiguous, on the CPU, with ``numel`` elements of this
        allreduce's dtype. Inside one host this goes through a
        :class:`~shmtrain.fabric.allreduce.pipeline.PipelinedAllreduce` (built on the first
        call, collectively), which moves each private byte through DRAM once in and once
        out; across hosts the local sum goes through this allreduce's slots as usual.
        """
        if self.leaders is None:
            if self._pipeline is None:
                self._pipeline = PipelinedAllreduce(self.host, tag=f"{self.tag}.pipe")
            return self._pipeline(tensor, op=self.op)
        flat = tensor.view(-1)
        self.input().copy_(flat)
        flat.copy_(self())
        return tensor

    @property
    def pipeline(self) -> PipelinedAllreduce | None:
        """The pipeline :meth:`reduce_private` runs on (None before its first call)."""
        return self._pipeline

    def close(self) -> None:
        """Release the stitched views (the result tensors must not be used afterwards)."""
        self.results = []
        if self._pipeline is not None:
            self._pipeline.close()
            self._pipeline = None
        for view in self._views:
            view.close()
        self._views = []
        self.slots = []
        self.segment.close()

    def _reduce_chunk(self, slots: list[torch.Tensor], lo: int, hi: int) -> None:
        me = self.host.local_rank
        peers = [slots[j] for j in range(len(slots)) if j != me]
        own = slots[me]
        if hi <= lo or not peers:
            return
        factor = 1.0 / (len(peers) + 1) if self.op == "mean" else 1.0
        if native.sum_into(own[lo:hi], [p[lo:hi] for p in peers], factor):  # float32: one pass, in C
            return
        for start in range(lo, hi, BLOCK_ELEMENTS):
            stop = min(start + BLOCK_ELEMENTS, hi)
            block = own[start:stop]
            for i, peer in enumerate(peers, start=2):
                if self.op == "mean":
                    block.lerp_(peer[start:stop], 1.0 / i)  # running mean of i inputs
                else:
                    block.add_(peer[start:stop])
