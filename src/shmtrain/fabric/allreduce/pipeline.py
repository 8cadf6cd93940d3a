"""Allreduce of *private* tensors inside one host, pipelined through cache-sized blocks.

What ``torch.distributed.all_reduce``, DDP, MPI and DeepSpeed offer: every rank hands in
its own tensor and wants the result back in it. The zero-copy
:class:`~shmtrain.fabric.allreduce.shared.ShmAllreduce` needs the inputs already in shared
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

That all-read path costs every rank ``L`` reads per byte: right at ``L = 2``, wrong from
``L = 4`` up. Per call, :func:`~shmtrain.fabric.allreduce.plan.choose` picks the
algorithm from a cost model of the machine (:mod:`shmtrain.fabric.allreduce.machine_model`,
measured once per machine and cached; local rank 0's copy is shared through the store
so every rank chooses alike): all-read, the split reduce-scatter + all-gather
(:meth:`_split`: rank ``r`` sums chunk ``r`` of every rank's block into a shared result
ring and its tensor, then copies the other chunks out; two hand-offs, about 2 reads and
1 write per byte), or on hosts with several NUMA nodes the two-level variant
(:meth:`_two_level`: a partial sum per node's group of ranks, then across the groups,
then the all-gather; three hand-offs). :attr:`last_plan` is the plan of the last call.

For float32 (gradients) the per-block work runs in C (:mod:`shmtrain.fabric.native`,
``pipeline_native.c``, built once per machine): the same ring, channels, sequence
numbers and sums, without the ~20-35 us of Python per call that lost small messages to
MPICH's compiled path. It waits in slices and returns to Python between them, so aborts,
dead peers and the timeout are judged here as on the Python path; a hand-off sleeps at
most once (on a completion word the last poster sets), never once per peer in a row.
Other dtypes, and machines without a C compiler, take the Python path.

Ring reuse needs no extra waits: with two slots, block ``k`` overwrites the slot of
block ``k - 2``, and every peer has finished reading that one because it has posted
block ``k - 1`` (a rank posts ``k - 1`` only after summing ``k - 2``), which this rank
waited for before summing ``k - 1`` (the two-level plan's first hand-off waits for the
rank's group only; its last one, over every rank, ends block ``k - 1`` everywhere before
block ``k`` starts). Sequence numbers run on across calls.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Literal

import torch

from shmtrain.fabric import native as _native
from shmtrain.fabric.allreduce.plan import (
    ALGORITHMS,
    Machine,
    Plan,
    block_bytes_for,
    choose,
    rank_groups,
    split,
)
from shmtrain.fabric.shm.control import SPIN_S, YIELDS, PeerTimeout
from shmtrain.fabric.shm.host import HostGroup
from shmtrain.fabric.shm.segment import align
from shmtrain.fabric.shm.stitch import PAGE

#: default bytes per block and rank on the Python path: measured best of 256 KiB..2 MiB
#: with 2 processes on 2 cores (16 MiB: 2.8 ms at 1 MiB blocks vs 3.5 ms at 256 KiB)
BLOCK_BYTES = 1 << 20
#: the most bytes per block on the compiled path (2 and 4 processes, 1-64 MiB: 512 KiB was
#: within 3% of the best of 128 KiB..4 MiB everywhere, e.g. 16 MiB / 2 procs 2.02 ms vs
#: 2.19 ms at 1 MiB; 4 procs on 2 cores 6.2 ms vs 7.2 ms at 2 MiB); smaller where the
#: ring of ``L`` ranks would not fit the shared cache (allreduce_plan.block_bytes_for)
NATIVE_BLOCK_BYTES = 512 << 10
RING = 2
_SLICE = 0.05  # seconds the compiled path waits before the caller checks peers and the timeout


class PipelinedAllreduce:
    """Sum or average private CPU tensors in place over the ``L`` workers of one host.

    Any size and any dtype torch can add: the ring does not depend on the tensor.
    Every local rank must call with tensors of the same numel and dtype, in the same
    order.

    Args:
        host: the host's workers.
        block_bytes: bytes per block (rounded to a page); default
            :func:`~shmtrain.fabric.allreduce.plan.block_bytes_for` (at most
            :data:`NATIVE_BLOCK_BYTES`) where the compiled path is available, else
            :data:`BLOCK_BYTES`.
        split: force the split path (True) or the all-read path (False); default: the
            plan of :func:`~shmtrain.fabric.allreduce.plan.choose`.
        spin: whether waits spin before sleeping (default: the host's rule, cores >= ranks);
            False for a reduction thread running beside its process's compute.
        tag: name fragment of the segment and channels.
        native: float32 through the compiled path (:mod:`shmtrain.fabric.native`); default:
            when it can be built here. Every local rank must choose alike.
        algorithm: force one of :data:`~shmtrain.fabric.allreduce.plan.ALGORITHMS` (default:
            ``$SHMTRAIN_ALLREDUCE_ALGORITHM`` where set, e.g. to compare plans in
            ``shmtrain bench allreduce``; else the cost model's choice per call).
        machine: the cost model's parameters; default: this machine's, measured once and
            cached (:func:`shmtrain.fabric.allreduce.machine_model.machine`), local rank 0's.
    """

    def __init__(self, host: HostGroup, *, block_bytes: int | None = None, split: bool | None = None,
                 spin: bool | None = None, tag: str = "pipeline", native: bool | None = None,
                 algorithm: str | None = None, machine: Machine | None = None) -> None:
        if split is not None:
            if algorithm is not None and algorithm != ("split" if split else "all-read"):
                raise ValueError(f"split={split} and algorithm={algorithm!r} disagree; pass one of them")
            algorithm = "split" if split else "all-read"
        if algorithm is not None and algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={algorithm!r}: choose one of {', '.join(ALGORITHMS)}, or None")
        forced = os.environ.get("SHMTRAIN_ALLREDUCE_ALGORITHM", "")
        if algorithm is None and forced:
            if forced not in ALGORITHMS:
                raise ValueError(f"SHMTRAIN_ALLREDUCE_ALGORITHM={forced!r}: choose one of {', '.join(ALGORITHMS)} "
                                 "(or unset it to let the cost model choose per call)")
            algorithm = forced
        self._lib = None
        if native is not False and host.local_world <= _native.MAXL:
            self._lib = _native.library()
        if native and self._lib is None:
            raise RuntimeError(f"the compiled allreduce path is not available: {_native.why_not}")
        if host.local_world > 1:  # every rank takes the same path: it decides the ring and the waits
            key = f"native/{tag}/{host.allocated}"
            host.store.add(key, 0 if self._lib is not None else 1)
            host.barrier(f"the {tag} allreduce's choice of path")
            if int(host.store.add(key, 0)) and self._lib is not None:
                if native:
                    raise RuntimeError("native=True, but a local rank of this host has no compiled path "
                                       "(its reason: see its log); pass native=None to let every rank fall back")
                self._lib = None
        L = host.local_world
        self.machine = machine if machine is not None else _shared_machine(host, tag)
        self.groups = rank_groups(L, self.machine)
        if algorithm == "two-level" and len(self.groups) < 2:
            raise ValueError(f"algorithm 'two-level' needs ranks on several NUMA nodes; here {self.groups}")
        S = len(self.groups) if len(self.groups) > 1 else 0  # partial sums only for two-level
        if block_bytes is None:
            block_bytes = block_bytes_for(L, S, self.machine) if self._lib else BLOCK_BYTES
        if block_bytes < PAGE:
            raise ValueError(f"block_bytes={block_bytes}: at least one page ({PAGE} bytes) per block")
        self.host = host
        self.algorithm = algorithm
        self.block_bytes = align(block_bytes, PAGE)
        # ring of inputs (RING x L blocks), the results (RING blocks), the two-level path's
        # partial sums (RING x groups blocks), then one page of the compiled path's sleep
        # announcements (a line per rank) and two of its completion words (all ranks'
        # posted, reduced, then one per group)
        self._partials_at = RING * (L + 1) * self.block_bytes
        self._announce_at = self._partials_at + RING * S * self.block_bytes
        self.segment = host.allocate(tag, self._announce_at + 3 * PAGE)
        self._channel = host.channel(f"{tag}.posted")
        self._reduced = host.channel(f"{tag}.reduced")  # 2k: block k's result; 2k - 1: its partials
        self.spin = spin
        self._views: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        self._plans: dict[tuple[int, torch.dtype], tuple[Plan, int]] = {}
        self.last_plan: Plan | None = None
        self.blocks = 0  # blocks posted so far (the sequence number of the last one)
        self._plan: _native.Plan | None = None

    @property
    def split(self) -> bool | None:
        """True or False where the split or all-read path was forced, else None (per plan)."""
        return None if self.algorithm is None else self.algorithm != "all-read"

    def use(self, algorithm: str | None) -> None:
        """Force ``algorithm`` from the next call on (None: the cost model's choice again);
        every local rank must do the same before the same call."""
        if algorithm is not None and algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={algorithm!r}: choose one of {', '.join(ALGORITHMS)}, or None")
        if algorithm == "two-level" and len(self.groups) < 2:
            raise ValueError(f"algorithm 'two-level' needs ranks on several NUMA nodes; here {self.groups}")
        self.algorithm = algorithm
        self._plans.clear()

    def plan(self, numel: int, dtype: torch.dtype) -> Plan:
        """The plan a call with ``numel`` elements of ``dtype`` runs (the same on every rank)."""
        return self._plan_and_code(numel, dtype)[0]

    def _plan_and_code(self, numel: int, dtype: torch.dtype) -> tuple[Plan, int]:
        """The plan and its algorithm's number on the compiled path (one lookup per call)."""
        found = self._plans.get((numel, dtype))
        if found is None:
            plan = choose(self.host.local_world, numel * dtype.itemsize, dtype.itemsize, self.machine,
                          block_bytes=self.block_bytes, algorithm=self.algorithm)
            found = self._plans[(numel, dtype)] = (plan, ALGORITHMS.index(plan.algorithm))
        return found

    def _ring(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The input ring as ``(RING, L, elements per block)`` of ``dtype``, the result
        ring ``(RING, elements per block)`` and the partial sums ``(RING, groups, ...)``."""
        view = self._views.get(dtype)
        if view is None:
            L, S = self.host.local_world, len(self.groups)
            per = self.block_bytes // torch.empty((), dtype=dtype).element_size()
            inputs = self.segment.tensor(dtype, 0, RING * L * per).view(RING, L, per)
            results = self.segment.tensor(dtype, RING * L * self.block_bytes, RING * per).view(RING, per)
            partials = None
            if S > 1:
                partials = self.segment.tensor(dtype, self._partials_at, RING * S * per).view(RING, S, per)
            view = self._views[dtype] = (inputs, results, partials)
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
        L = self.host.local_world
        numel = tensor.numel()
        if L == 1 or numel == 0:
            return tensor
        plan, code = self._plan_and_code(numel, tensor.dtype)
        self.last_plan = plan
        if self._lib is not None and tensor.dtype == torch.float32:
            if tensor.requires_grad and torch.is_grad_enabled():
                raise RuntimeError("PipelinedAllreduce reduces in place: a tensor that requires grad must be "
                                   "reduced under torch.no_grad() (or pass its .detach())")
            self._compiled(tensor, numel, op, code)
            torch.autograd.graph.increment_version(tensor)  # written through a raw pointer
            return tensor
        flat = tensor.view(-1)
        run = {"all-read": self._all_read, "split": self._split, "two-level": self._two_level}[plan.algorithm]
        run(flat, op)
        return tensor

    def _hand_off(self, channel: int, value: int, ranks, what: str) -> None:
        """Post ``value`` on this rank's word of ``channel``; wait until ``ranks`` have."""
        host = self.host
        host.control.post(channel, host.local_rank, value)
        host.control.wait(channel, ranks, value, timeout=host.timeout, what=what, spin=self.spin)

    def _all_read(self, flat: torch.Tensor, op: str) -> None:
        """One hand-off per block: every rank sums all ``L`` slots into its own tensor."""
        me = self.host.local_rank
        ring = self._ring(flat.dtype)[0]
        per = ring.shape[2]
        for start in range(0, flat.numel(), per):
            stop = min(start + per, flat.numel())
            m = stop - start
            self.blocks += 1
            slot = ring[self.blocks % RING]
            out = flat[start:stop]
            slot[me, :m].copy_(out)
            self._hand_off(self._channel, self.blocks, self.host.ranks, "a block of the allreduce")
            all_read_sum(out, slot[:, :m], me, op == "mean")

    def _split(self, flat: torch.Tensor, op: str) -> None:
        """Two hand-offs per block, about 2 reads and 1 write per byte at any ``L``: rank
        ``r`` copies in every chunk but its own, sums chunk ``r`` of the ``L`` inputs (its
        own from its tensor) into the result ring and its tensor, then copies the other
        chunks of the result out (reduce-scatter + all-gather; PAR-SUM, swCaffe Section V-A)."""
        L, me = self.host.local_world, self.host.local_rank
        ring, results, _ = self._ring(flat.dtype)
        per = ring.shape[2]
        for start in range(0, flat.numel(), per):
            stop = min(start + per, flat.numel())
            m = stop - start
            self.blocks += 1
            k = self.blocks
            slot, result, out = ring[k % RING], results[k % RING], flat[start:stop]
            lo, hi = split(m, L)[me]
            slot[me, :lo].copy_(out[:lo])
            slot[me, hi:m].copy_(out[hi:m])
            self._hand_off(self._channel, k, self.host.ranks, "a block of the allreduce")
            if hi > lo:
                rows = [out[lo:hi] if j == me else slot[j, lo:hi] for j in range(L)]
                _sum_rows(result[lo:hi], rows, op == "mean")
                out[lo:hi].copy_(result[lo:hi])
            self._hand_off(self._reduced, 2 * k, self.host.ranks, "a reduced block of the allreduce")
            out[:lo].copy_(result[:lo])
            out[hi:m].copy_(result[hi:m])

    def _two_level(self, flat: torch.Tensor, op: str) -> None:
        """Three hand-offs per block for hosts with several NUMA nodes: inside each node's
        group of ranks the split reduction into the group's partial sum (reads stay on the
        node), then rank ``r`` sums piece ``r`` of every group's partial, then the all-gather."""
        L, me = self.host.local_world, self.host.local_rank
        ring, results, partials = self._ring(flat.dtype)
        g = next(i for i, members in enumerate(self.groups) if me in members)
        members = self.groups[g]
        per = ring.shape[2]
        for start in range(0, flat.numel(), per):
            stop = min(start + per, flat.numel())
            m = stop - start
            self.blocks += 1
            k = self.blocks
            slot, result, out = ring[k % RING], results[k % RING], flat[start:stop]
            glo, ghi = split(m, len(members))[members.index(me)]
            slot[me, :glo].copy_(out[:glo])
            slot[me, ghi:m].copy_(out[ghi:m])
            self._hand_off(self._channel, k, members, "a block of the allreduce")
            if ghi > glo:
                rows = [out[glo:ghi] if j == me else slot[j, glo:ghi] for j in members]
                _sum_rows(partials[k % RING, g, glo:ghi], rows, False)
            self._hand_off(self._reduced, 2 * k - 1, self.host.ranks, "a partial sum of the allreduce")
            lo, hi = split(m, L)[me]
            if hi > lo:
                _sum_rows(result[lo:hi], [partials[k % RING, s, lo:hi] for s in range(len(self.groups))],
                          op == "mean", L)
                out[lo:hi].copy_(result[lo:hi])
            self._hand_off(self._reduced, 2 * k, self.host.ranks, "a reduced block of the allreduce")
            out[:lo].copy_(result[:lo])
            out[hi:m].copy_(result[hi:m])

    def _compiled(self, tensor: torch.Tensor, numel: int, op: str, algorithm: int) -> None:
        """The same blocks through the compiled path (:mod:`shmtrain.fabric.native`): C does
        the copies, posts, waits and sums; every ``_SLICE`` of waiting it returns here so
        that aborts, dead peers and the timeout are judged as on the Python path."""
        if self._plan is None:
            self._make_plan()
        progress = self._progress
        progress.pos, progress.seq, progress.phase = 0, self.blocks, 0
        args = (self._plan_ref, self._progress_ref, tensor.data_ptr(), numel, algorithm, op == "mean", _SLICE)
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
            what = "a reduced block of the allreduce" if progress.phase >= 2 else "a block of the allreduce"
            control.check(peer, what)  # raises PeerFailure on an abort or a dead peer
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
        base, posted = control.word_layout(self._channel)[:2]
        _, reduced, sleepers = control.word_layout(self._reduced)
        plan.ctrl = base
        plan.announce = self.segment.address(self._announce_at)
        plan.done = self.segment.address(self._announce_at + PAGE)
        plan.per = self.block_bytes // 4
        for r in range(L):
            plan.posted[r], plan.reduced[r], plan.sleepers[r] = posted[r], reduced[r], sleepers[r]
        plan.L, plan.me = L, host.local_rank
        me = host.local_rank
        group = next(g for g, members in enumerate(self.groups) if me in members)
        plan.partials = self.segment.address(self._partials_at)
        plan.S, plan.group = len(self.groups), group
        plan.G, plan.gindex = len(self.groups[group]), self.groups[group].index(me)
        for i, r in enumerate(self.groups[group]):
            plan.members[i] = r
        for r in range(L):
            plan.all[r] = r
        spin = control.spin if self.spin is None else self.spin
        # as ControlBlock.wait: spin when asked, yield when ranks outnumber cores, else sleep
        plan.mode = 0 if spin else (1 if not control.spin else 2)
        plan.spin_ns, plan.yields = int(SPIN_S * 1e9), YIELDS
        self._plan, self._plan_ref = plan, ctypes.byref(plan)
        self._progress = _native.Progress()
        self._progress_ref = ctypes.byref(self._progress)
        self._run = self._lib.shm_pipeline_f32

    def close(self) -> None:
        """Release the ring (no call may follow)."""
        self._views = {}
        self.segment.close()


def all_read_sum(out: torch.Tensor, rows: torch.Tensor, me: int, mean: bool) -> None:
    """The all-read path's sum of one block: ``out`` (this rank's row, ``rows[me]``'s
    values) <- the sum of the ``L`` rows of ``rows`` (``(L, m)``), divided by ``L`` where
    ``mean``. With 2 ranks own + peer (addition commutes: both ranks get the same bits),
    else in rank order (integers do not widen). The backend's small calls, whose data came
    with their header, sum through this too."""
    L = rows.shape[0]
    if L == 2:
        out.add_(rows[1 - me])
    elif out.is_floating_point():
        torch.sum(rows, dim=0, out=out)
    else:  # torch.sum would widen integers
        out.copy_(rows[0])
        for j in range(1, L):
            out.add_(rows[j])
    if mean:
        out.mul_(1.0 / L)


def _sum_rows(out: torch.Tensor, rows: list[torch.Tensor], mean: bool, count: int | None = None) -> None:
    """``out = ((rows[0] + rows[1]) + ...)`` in this order (integers do not widen), then
    divided by ``count`` (default ``len(rows)``) when ``mean``."""
    if len(rows) == 1:
        out.copy_(rows[0])
    else:
        torch.add(rows[0], rows[1], out=out)
    for row in rows[2:]:
        out.add_(row)
    if mean:
        out.mul_(1.0 / (count or len(rows)))


def _shared_machine(host: HostGroup, tag: str) -> Machine:
    """Local rank 0's :func:`shmtrain.fabric.allreduce.machine_model.machine`, through the store: every
    rank must choose the same plans, so they must not each measure."""
    from shmtrain.fabric.allreduce import machine_model

    if host.local_world == 1:
        return machine_model.machine()
    key = f"machine/{tag}/{host.allocated}"
    if host.local_rank == 0:
        host.store.set(key, machine_model.to_json(machine_model.machine()))
    return machine_model.from_json(host.store.get(key).decode(), "local rank 0's machine description")


__all__ = ["BLOCK_BYTES", "NATIVE_BLOCK_BYTES", "PAGE", "RING", "PipelinedAllreduce", "all_read_sum", "split"]
