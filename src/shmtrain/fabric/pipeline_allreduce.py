"""Allreduce of *private* tensors inside one host, pipelined through cache-sized blocks.

What ``torch.distributed.all_reduce``, DDP, MPI and DeepSpeed offer: every rank hands in
its own tensor and wants the result back in it. The zero-copy
:class:`~shmtrain.fabric.shm_allreduce.ShmAllreduce` needs the inputs already in shared
slots; copying a private tensor in, reducing, and copying the result out moves every
byte through DRAM three times more than necessary.

Here the tensor goes through a small ring of shared blocks instead (``ring`` slots of
``block_bytes`` per rank, a few MiB in all, so it stays in the cores' caches). For each
block of the tensor, every local rank

1. copies its block into its ring slot (a read of its private memory),
2. posts the block's sequence number and waits until every rank has posted it
   (one hand-off per block: the only synchronisation),
3. sums the ``L`` slots of that block, in rank order, straight into its own tensor
   (the ``L`` reads come from cache, the write is the one store its result needs).

So each rank's private bytes cross DRAM once in and once out, and every rank computes
bit-identical sums (same inputs, same order). A small message is one block: one copy,
one hand-off, one sum, against two hand-offs (reduce-scatter, then gather) for the
split reduction of swCaffe's PAR-SUM (Section V-A).

When ranks outnumber cores (4 workers on 2 cores here), every byte of work is time on
a shared core, so the block is instead reduced split ``L`` ways (:meth:`_split`: each
rank sums its ``1/L`` into a shared result ring, then every rank copies the result
out), with bigger blocks for fewer hand-offs.

For float32 (gradients) the per-block work runs in C (:mod:`shmtrain.fabric.native`,
``pipeline_native.c``, built once per machine): the same ring, channels, sequence
numbers and sums, without the ~20-35 us of Python per call that lost small messages to
MPICH's compiled path. It waits in slices and returns to Python between them, so aborts,
dead peers and the timeout are judged here as on the Python path. Other dtypes, and
machines without a C compiler, take the Python path.

Ring reuse needs no extra waits: with two slots, block ``k`` overwrites the slot of
block ``k - 2``, and every peer has finished reading that one because it has posted
block ``k - 1`` (a rank posts ``k - 1`` only after summing ``k - 2``), which this rank
waited for before summing ``k - 1``. Sequence numbers run on across calls.
"""

from __future__ import annotations

import ctypes
import time
from typing import Literal

import torch

from shmtrain.fabric import native as _native
from shmtrain.fabric.control import _SPIN_S, _YIELDS, PeerTimeout
from shmtrain.fabric.host import HostGroup
from shmtrain.fabric.segment import align
from shmtrain.fabric.stitch import PAGE

#: default bytes per block and rank (all-read path): measured best of 256 KiB..2 MiB
#: with 2 processes on 2 cores (16 MiB: 2.8 ms at 1 MiB blocks vs 3.5 ms at 256 KiB)
BLOCK_BYTES = 1 << 20
#: default for the split path (ranks outnumber cores): fewer hand-offs per byte
SPLIT_BLOCK_BYTES = 2 << 20
#: default bytes per block on the compiled path (2 and 4 processes, 1-64 MiB: 512 KiB was
#: within 3% of the best of 128 KiB..4 MiB everywhere, e.g. 16 MiB / 2 procs 2.02 ms vs
#: 2.19 ms at 1 MiB; 4 procs on 2 cores 6.2 ms vs 7.2 ms at 2 MiB)
NATIVE_BLOCK_BYTES = 512 << 10
#: on the compiled path a message up to this size takes the all-read path even when ranks
#: outnumber cores (4 procs on 2 cores: 256 KiB 0.14 ms all-read vs 0.30 ms split)
SMALL_BYTES = 256 << 10
RING = 2
_SLICE = 0.05  # seconds the compiled path waits before the caller checks peers and the timeout


class PipelinedAllreduce:
    """Sum or average private CPU tensors in place over the ``L`` workers of one host.

    Any size and any dtype torch can add: the ring does not depend on the tensor.
    Every local rank must call with tensors of the same numel and dtype, in the same
    order.

    Args:
        host: the host's workers.
        block_bytes: bytes per block (rounded to a page); default :data:`NATIVE_BLOCK_BYTES`
            where the compiled path is available, else :data:`BLOCK_BYTES`, or
            :data:`SPLIT_BLOCK_BYTES` on the split path.
        split: reduce each block split ``L`` ways (two hand-offs, ``2L`` block reads) instead
            of every rank summing the whole block (one hand-off, ``L * L`` reads); default:
            split when the host's ranks outnumber its cores (on the compiled path only for
            messages above :data:`SMALL_BYTES`).
        spin: whether waits spin before sleeping (default: the host's rule, cores >= ranks);
            False for a reduction thread running beside its process's compute.
        tag: name fragment of the segment and channels.
        native: float32 through the compiled path (:mod:`shmtrain.fabric.native`); default:
            when it can be built here. Every local rank must choose alike.
    """

    def __init__(self, host: HostGroup, *, block_bytes: int | None = None, split: bool | None = None,
                 spin: bool | None = None, tag: str = "pipeline", native: bool | None = None) -> None:
        self._lib = None
        if native is not False and host.local_world <= _native.MAXL:
            self._lib = _native.library()
        if native and self._lib is None:
            raise RuntimeError(f"the compiled allreduce path is not available: {_native.why_not}")
        if host.local_world > 1:  # every rank takes the same path: it decides the ring and the waits
            key = f"native/{tag}/{host._segments}"
            host.store.add(key, 0 if self._lib is not None else 1)
            host.barrier(f"the {tag} allreduce's choice of path")
            if int(host.store.add(key, 0)) and self._lib is not None:
                if native:
                    raise RuntimeError("native=True, but a local rank of this host has no compiled path "
                                       "(its reason: see its log); pass native=None to let every rank fall back")
                self._lib = None
        self._auto_split = split is None
        split = split if split is not None else not host.control.spin
        if block_bytes is None:
            block_bytes = NATIVE_BLOCK_BYTES if self._lib else SPLIT_BLOCK_BYTES if split else BLOCK_BYTES
        if block_bytes < PAGE:
            raise ValueError(f"block_bytes={block_bytes}: at least one page ({PAGE} bytes) per block")
        self.host = host
        self.block_bytes = align(block_bytes, PAGE)
        # ring of inputs (RING x L blocks), then the split path's results (RING blocks), then
        # one page of the compiled path's sleep announcements (a line per rank)
        self._announce_at = RING * (host.local_world + 1) * self.block_bytes
        self.segment = host.allocate(tag, self._announce_at + PAGE)
        self._channel = host.channel(f"{tag}.posted")
        self._reduced = host.channel(f"{tag}.reduced")
        self.split = split
        self.spin = spin
        self._views: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self.blocks = 0  # blocks posted so far (the sequence number of the last one)
        self._plan: _native.Plan | None = None

    def _ring(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The input ring as ``(RING, L, elements per block)`` of ``dtype``, and the result
        ring ``(RING, elements per block)``."""
        view = self._views.get(dtype)
        if view is None:
            L = self.host.local_world
            per = self.block_bytes // torch.empty((), dtype=dtype).element_size()
            inputs = self.segment.tensor(dtype, 0, RING * L * per).view(RING, L, per)
            results = self.segment.tensor(dtype, RING * L * self.block_bytes, RING * per).view(RING, per)
            view = self._views[dtype] = (inputs, results)
        return view

    def __call__(self, tensor: torch.Tensor, op: Literal["sum", "mean"] = "sum") -> torch.Tensor:
        """Reduce ``tensor`` (contiguous, CPU) in place over the host; returns it."""
        if op not in ("sum", "mean"):
            raise ValueError(f"op {op!r} must be 'sum' or 'mean'")
        if not tensor.is_cpu or not tensor.is_contiguous():
            raise ValueError(f"PipelinedAllreduce reduces contiguous CPU tensors; got one on {tensor.device} "
                             f"(contiguous: {tensor.is_contiguous()})")
        if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
            raise ValueError(f"op 'mean' needs a floating-point tensor, got {tensor.dtype}; sum it and divide")
        host, control = self.host, self.host.control
        L, me = host.local_world, host.local_rank
        numel = tensor.numel()
        if L == 1 or numel == 0:
            return tensor
        if self._lib is not None and tensor.dtype == torch.float32:  # the hot path: few Python steps
            if tensor.requires_grad and torch.is_grad_enabled():
                raise RuntimeError("PipelinedAllreduce reduces in place: a tensor that requires grad must be "
                                   "reduced under torch.no_grad() (or pass its .detach())")
            self._compiled(tensor, numel, op, self.split and not (self._auto_split and numel * 4 <= SMALL_BYTES))
            torch.autograd.graph.increment_version(tensor)  # written through a raw pointer
            return tensor
        flat = tensor.view(-1)
        ring, results = self._ring(flat.dtype)
        per = ring.shape[2]
        if self.split:
            self._split(flat, ring, results, op)
            return tensor
        channel, ranks, timeout = self._channel, host.ranks, host.timeout
        scale = 1.0 / L if op == "mean" else None
        for start in range(0, flat.numel(), per):
            stop = min(start + per, flat.numel())
            m = stop - start
            self.blocks += 1
            k = self.blocks
            slot = ring[k % RING]
            out = flat[start:stop]
            slot[me, :m].copy_(out)
            control.post(channel, me, k)
            control.wait(channel, ranks, k, timeout=timeout, what="a block of the allreduce", spin=self.spin)
            if L == 2:  # own + peer: addition commutes, so both ranks get the same bits
                out.add_(slot[1 - me, :m])
            elif out.is_floating_point():
                torch.sum(slot[:, :m], dim=0, out=out)
            else:  # torch.sum would widen integers
                out.copy_(slot[0, :m])
                for j in range(1, L):
                    out.add_(slot[j, :m])
            if scale is not None:
                out.mul_(scale)
        return tensor

    def _split(self, flat: torch.Tensor, ring: torch.Tensor, results: torch.Tensor, op: str) -> None:
        """Two hand-offs per block, less work: rank ``r`` sums its ``1/L`` of the block
        into the result ring, then every rank copies the whole result out. Total reads
        per block ``L + L`` blocks against ``L * L`` for the all-read path: the better
        trade when ranks outnumber cores and every byte of work is time on a shared core."""
        host, control = self.host, self.host.control
        L, me = host.local_world, host.local_rank
        per = ring.shape[2]
        ranks, timeout = host.ranks, host.timeout
        for start in range(0, flat.numel(), per):
            stop = min(start + per, flat.numel())
            m = stop - start
            self.blocks += 1
            k = self.blocks
            slot, result = ring[k % RING], results[k % RING]
            out = flat[start:stop]
            slot[me, :m].copy_(out)
            control.post(self._channel, me, k)
            control.wait(self._channel, ranks, k, timeout=timeout, what="a block of the allreduce", spin=self.spin)
            lo, hi = split(m, L)[me]
            if hi > lo:
                mine = result[lo:hi]
                if out.is_floating_point():
                    torch.sum(slot[:, lo:hi], dim=0, out=mine)
                else:
                    mine.copy_(slot[0, lo:hi])
                    for j in range(1, L):
                        mine.add_(slot[j, lo:hi])
                if op == "mean":
                    mine.mul_(1.0 / L)
            control.post(self._reduced, me, k)
            control.wait(self._reduced, ranks, k, timeout=timeout, what="a reduced block of the allreduce",
                         spin=self.spin)
            out.copy_(result[:m])

    def _compiled(self, tensor: torch.Tensor, numel: int, op: str, split: bool) -> None:
        """The same blocks through the compiled path (:mod:`shmtrain.fabric.native`): C does
        the copies, posts, waits and sums; every ``_SLICE`` of waiting it returns here so
        that aborts, dead peers and the timeout are judged as on the Python path."""
        if self._plan is None:
            self._make_plan()
        progress = self._progress
        progress.pos, progress.seq, progress.phase = 0, self.blocks, 0
        args = (self._plan_ref, self._progress_ref, tensor.data_ptr(), numel, split, op == "mean", _SLICE)
        try:
            if self._run(*args) != 0:
                self._wait_on(args)
        finally:
            self.blocks = progress.seq

    def _wait_on(self, args: tuple) -> None:
        """A compiled call that has waited ``_SLICE``: check the peer, then resume, until done."""
        progress, control, timeout = self._progress, self.host.control, self.host.timeout
        deadline, where = 0.0, None
        while True:
            peer = progress.waiting
            what = "a reduced block of the allreduce" if progress.phase == 2 else "a block of the allreduce"
            control._check(peer, what)  # raises PeerFailure on an abort or a dead peer
            now = time.monotonic()
            if (progress.seq, progress.phase) != where:  # a new hand-off: its own timeout, as in Python
                deadline, where = now + timeout, (progress.seq, progress.phase)
            elif now >= deadline:
                raise PeerTimeout(f"local rank {peer} (pid {control.pid(peer)}) did not reach {what} "
                                  f"#{progress.seq} within {timeout:.0f} s", peer=peer)
            if self._run(*args) == 0:
                return

    def _make_plan(self) -> None:
        """The C side's view of this ring and the host's control block (built once)."""
        host, control = self.host, self.host.control
        L = host.local_world
        plan = _native.Plan()
        plan.ring = self.segment.address(0)
        plan.results = self.segment.address(RING * L * self.block_bytes)
        plan.ctrl = control._base
        plan.announce = self.segment.address(self._announce_at)
        plan.per = self.block_bytes // 4
        for r in range(L):
            plan.posted[r] = control._index(self._channel, r)
            plan.reduced[r] = control._index(self._reduced, r)
            plan.sleepers[r] = control._sleepers[r]
        plan.L, plan.me = L, host.local_rank
        spin = control.spin if self.spin is None else self.spin
        # as ControlBlock.wait: spin when asked, yield when ranks outnumber cores, else sleep
        plan.mode = 0 if spin else (1 if not control.spin else 2)
        plan.spin_ns, plan.yields = int(_SPIN_S * 1e9), _YIELDS
        self._plan, self._plan_ref = plan, ctypes.byref(plan)
        self._progress = _native.Progress()
        self._progress_ref = ctypes.byref(self._progress)
        self._run = self._lib.shm_pipeline_f32

    def close(self) -> None:
        """Release the ring (no call may follow)."""
        self._views = {}
        self.segment.close()


def split(numel: int, parts: int, granule: int = 16) -> list[tuple[int, int]]:
    """Split ``[0, numel)`` into ``parts`` contiguous ranges, boundaries on ``granule``."""
    per = -(-numel // parts) if parts else numel
    per = -(-per // granule) * granule
    return [(min(i * per, numel), min((i + 1) * per, numel)) for i in range(parts)]
