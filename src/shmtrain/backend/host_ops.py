"""The ``shm`` backend's collectives other than the sum, inside one host, through a ring of
shared blocks.

A call whose every rank's data fits in the call ring's payload (:mod:`~shmtrain.backend.calls`,
:data:`~shmtrain.backend.calls.CALL_BYTES`) is one block there: each rank writes what it
sends beside its header, the header's hand-off is the block's, and each reads what it
receives from the others' lines (one hand-off for the whole call). A larger call passes its
header alone, then goes through the ring below, block after block.

Every local rank owns one slot of ``block_bytes`` in each of the ring's two positions. A
block of a call is one hand-off: each rank writes what it sends into its slot, posts the
block's sequence number on the ring's channel, waits until every local rank has posted
it, then reads what it receives from the others' slots. Ring reuse needs no other wait:
block ``k`` overwrites the slots of block ``k - 2``, which every rank finished reading
before it posted block ``k - 1``, which this rank waited for (the argument of the
pipelined allreduce, :mod:`shmtrain.fabric.allreduce.pipeline`). Sequence numbers run on
across calls and ops, so calls of any ops follow each other without a barrier.

What each op moves per block (``L`` local ranks, ``B`` bytes a slot):

- all_gather: every rank its next ``B`` bytes; every rank copies all ``L`` slots out;
- broadcast: the root its next ``B`` bytes; the others copy its slot out;
- reduce_scatter, all_reduce (MAX, MIN, PRODUCT, bitwise), reduce: every rank its next
  piece for each destination (for all_reduce and reduce: the same piece for all); each
  combines the ``L`` pieces of its own destination in rank order (so every rank that
  computes a piece computes the same bits);
- all_to_all: every rank its next ``B / L`` bytes for each destination, uneven sizes
  included (a rank whose data for a peer has ended sends nothing more to it); the number
  of blocks is every rank's largest, exchanged in a first block;
- gather, scatter: the ranks' pieces into the root, the root's pieces out to each rank.

Where the compiled library is there (:mod:`shmtrain.fabric.native`, ``ring_native.c``; every
local rank alike, the pipeline's choice), the blocks of all_gather, broadcast and gather, and
of the float32 reductions (reduce_scatter; all_reduce and reduce of MAX, MIN, PRODUCT;
SUM and AVG), run in C: the same ring, sequence numbers, block sizes and rank order, so
the same bits, without Python per block; a rank's own piece of a reduce_scatter is read
from its input, not copied into the ring. C hands back a block that holds an element whose
bits torch's kernels may set otherwise than a plain loop (a NaN, or for MAX and MIN zeros
of opposite signs), and it is combined with torch, as on the Python path. It waits in
slices and returns here between them, so aborts, dead peers and the timeout are judged as
on the Python path.

Each method takes contiguous tensors (the backend makes copies of strided ones) and ``begin``,
the call's header hand-off (``begin(own=...)``, :meth:`HostReducer.begin
<shmtrain.backend.reducer.HostReducer.begin>` of the call's header), and runs on
the group's reduction thread or the caller's (:class:`~shmtrain.backend.reducer.HostReducer`
decides, and keeps the calls of every op in the order they were issued).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shmtrain.backend.calls import CallRing, native_plan, wait_mode
from shmtrain.backend.reduce_ops import as_bytes, average
from shmtrain.backend.reduce_ops import combine as combining
from shmtrain.fabric import native as _native
from shmtrain.fabric.shm.control import PeerTimeout
from shmtrain.fabric.shm.host import HostGroup
from shmtrain.fabric.shm.stitch import PAGE

RING = 2
#: bytes of a rank's slot: 1 MiB (the pipelined allreduce's block on the Python path)
BLOCK_BYTES = 1 << 20
#: the compiled path's reductions (``ring_native.c``'s op codes are the index), float32 only
NATIVE_OPS = ("SUM", "AVG", "MAX", "MIN", "PRODUCT")
_SLICE = 0.05  # seconds the compiled path waits before the caller checks peers and the timeout


class HostOps:
    """The ring and the ops of one group's host (module docstring).

    Args:
        host: the host's workers of the group.
        spin: whether waits spin before sleeping (the reducer's rule).
        calls: the group's call ring (a small call's one block).
        block_bytes: bytes of one rank's slot.
        tag: name fragment of the segment and the channel.
    """

    def __init__(self, host: HostGroup, spin: bool | None, calls: CallRing, block_bytes: int = BLOCK_BYTES,
                 tag: str = "pg-ops") -> None:
        self.host, self.spin, self.block_bytes, self.calls = host, spin, block_bytes, calls
        self.L, self.me = host.local_world, host.local_rank
        ring_bytes = RING * self.L * block_bytes
        # the ring, then the compiled path's announcements (a line per rank) and completion word
        self.segment = host.allocate(tag, ring_bytes + 2 * PAGE)
        self._ring = self.segment.tensor(torch.uint8, 0, ring_bytes).view(RING, self.L, block_bytes)
        self._channel = host.channel(f"{tag}.posted")
        self.blocks = 0  # blocks exchanged so far (the sequence number of the last one)
        self.phase = ""  # what a failed wait was waiting for (errors name it)
        #: blocks the compiled path handed back to be combined with torch (special values)
        self.handed_back = 0
        #: the compiled library (the call ring's: every local rank alike), None: the Python path
        self.lib: Any = calls._lib if block_bytes % 4 == 0 else None
        if self.lib is not None:
            self._plan = native_plan(host, spin, self.segment, 0, ring_bytes, block_bytes, self._channel)
            self._progress = _native.Progress()
            self._plan_ref, self._progress_ref = ctypes.byref(self._plan), ctypes.byref(self._progress)

    # -- the one primitive ----------------------------------------------------------
    def _carried(self, begin: Callable[..., object], whole: int) -> bool:
        """Whether a call whose one block would take ``whole`` bytes of each rank's line
        (the same on every rank: the header's sizes decide it) travels with its header: then
        the caller writes its line and calls ``begin``; else its header goes now, alone,
        and the call goes through the ring."""
        if 0 < whole <= self.calls.payload_bytes:
            return True
        begin()
        return False

    def _next(self) -> torch.Tensor:
        """The next block's slots, ``(L, block_bytes)`` bytes; write this rank's row, then
        :meth:`_swap`."""
        self.blocks += 1
        return self._ring[self.blocks % RING]

    def _swap(self, what: str) -> None:
        """Post this block; wait until every local rank has posted it."""
        control = self.host.control
        self.phase = f"reach a block of {what}"
        control.post(self._channel, self.me, self.blocks)
        control.wait(self._channel, self.host.ranks, self.blocks, timeout=self.host.timeout, what=f"a block of {what}",
                     spin=self.spin)

    def _native(self, run: Callable[..., int], args: tuple, what: str) -> int:
        """Run a compiled call (``args`` after the plan and the progress record) from block
        :attr:`blocks` + 1 on: every ``_SLICE`` of waiting it returns here, and the peer
        waited for is checked (an abort or a dead peer raises) and each block's wait has
        the group's timeout, as on the Python path. Returns its last code (0: done, 3: a
        block to combine here, see :meth:`_reduce_native`)."""
        progress, control, timeout = self._progress, self.host.control, self.host.timeout
        self._plan.mode = wait_mode(control, self.calls.spin)
        args = (self._plan_ref, self._progress_ref, *args, _SLICE)
        deadline, where = 0.0, None
        self.phase = f"reach a block of {what}"
        try:
            while True:
                rc = run(*args)
                if rc == 0 or rc == 3:
                    return rc
                peer = progress.waiting
                control.check(peer, f"a block of {what}")  # raises PeerFailure on an abort or a dead peer
                now = time.monotonic()
                if progress.seq != where:  # a new block: its own timeout, as on the Python path
                    deadline, where = now + timeout, progress.seq
                elif now >= deadline:
                    raise PeerTimeout(f"local rank {peer} (pid {control.pid(peer)}) did not reach a block of "
                                      f"{what} #{progress.seq} within {timeout:.0f} s", peer=peer)
        finally:
            self.blocks = progress.seq

    def _start(self) -> None:
        progress = self._progress
        progress.pos, progress.seq, progress.phase = 0, self.blocks, 0

    def _collect_native(self, send: torch.Tensor | None, recvs: Sequence[torch.Tensor | None], n: int,
                        what: str) -> None:
        """The blocks of a gather-like call in C (``shm_ring_collect``): ``send`` (bytes,
        None: this rank sends nothing) out, ``recvs[r]`` (bytes, None: not received) in."""
        pointers = (ctypes.c_void_p * self.L)(*(None if t is None else t.data_ptr() for t in recvs))
        self._start()
        self._native(self.lib.shm_ring_collect, (None if send is None else send.data_ptr(), pointers, n,
                                                 self.block_bytes), what)
        written = [t for r, t in enumerate(recvs) if t is not None and (r != self.me or t.data_ptr() != (
            0 if send is None else send.data_ptr()))]
        if written:
            torch.autograd.graph.increment_version(written)  # written through raw pointers

    def _exchange_native(self, recvs: Sequence[torch.Tensor], sends: Sequence[torch.Tensor], blocks: int,
                         per: int) -> None:
        """all_to_all's ``blocks`` blocks in C (``shm_ring_exchange``): ``per`` bytes for each
        destination a block, ``sends[j]`` and ``recvs[i]`` flat bytes of any sizes."""
        L = self.L
        send_at = (ctypes.c_void_p * L)(*(t.data_ptr() for t in sends))
        send_n = (ctypes.c_int64 * L)(*(t.numel() for t in sends))
        recv_at = (ctypes.c_void_p * L)(*(t.data_ptr() for t in recvs))
        recv_n = (ctypes.c_int64 * L)(*(t.numel() for t in recvs))
        self._start()
        self._native(self.lib.shm_ring_exchange, (send_at, send_n, recv_at, recv_n, blocks, per), "all_to_all")
        torch.autograd.graph.increment_version(list(recvs))  # written through raw pointers

    def _reduce_native(self, out: torch.Tensor, sends: Sequence[torch.Tensor], op: str, same: bool, root: int,
                       what: str) -> None:
        """The blocks of a float32 reduction in C (``shm_ring_reduce_f32``): ``out`` (flat)
        <- the ranks' pieces in rank order (``root`` >= 0: that rank's only). A block that C
        hands back (code 3) is combined here with torch, from the same rows in the same
        order as on the Python path, then C goes on."""
        n = out.numel()
        per = (self.block_bytes // 4) // (1 if same else self.L)
        pointers = (ctypes.c_void_p * len(sends))(*(t.data_ptr() for t in sends))
        args = (pointers, out.data_ptr(), n, int(same), NATIVE_OPS.index(op), root, self.block_bytes // 4)
        self._start()
        progress = self._progress
        while self._native(self.lib.shm_ring_reduce_f32, args, what) == 3:
            start = progress.pos
            stop = min(start + per, n)
            slots = self._ring[progress.seq % RING].view(torch.float32)
            at = 0 if same else self.me * per
            rows = [slots[r, at:at + stop - start] if same or r != self.me else sends[r][start:stop]
                    for r in range(self.L)]
            piece = out[start:stop]
            piece.copy_(rows[0])
            combine = combining(op)
            for r in range(1, self.L):
                combine(piece, rows[r])
            if op == "AVG":
                average(piece, self.L)
            progress.pos, progress.phase = stop, 0
            self.handed_back += 1
        torch.autograd.graph.increment_version(out)  # written through a raw pointer

    def _native_reduces(self, out: torch.Tensor, sends: Sequence[torch.Tensor], op: str, same: bool) -> bool:
        """Whether a reduction goes through :meth:`_reduce_native`: the library, float32, an
        op of :data:`NATIVE_OPS`, and (not ``same``) an output that overlaps no input."""
        if self.lib is None or out.dtype != torch.float32 or op not in NATIVE_OPS:
            return False
        if same:
            return True
        lo, hi = out.data_ptr(), out.data_ptr() + out.numel() * 4
        return all(t.data_ptr() + t.numel() * 4 <= lo or t.data_ptr() >= hi for t in sends)

    def _combined(self, out: torch.Tensor, rows: torch.Tensor, op: str) -> None:
        """``out`` <- ``rows[0] (op) rows[1] (op) ...`` in rank order (every rank that
        computes a piece computes the same bits)."""
        combine = combining(op)
        out.copy_(rows[0])
        for r in range(1, self.L):
            combine(out, rows[r])

    # -- ops ------------------------------------------------------------------------
    def all_gather(self, outputs: Sequence[torch.Tensor] | torch.Tensor, input: torch.Tensor,
                   begin: Callable[..., object]) -> None:
        """``outputs[r]`` <- rank ``r``'s ``input`` (every rank the same number of bytes);
        ``outputs`` one contiguous tensor: rank ``r``'s in its ``r``-th piece
        (``all_gather_into_tensor``)."""
        self._collect(outputs, input, "all_gather", begin)

    def _collect(self, outputs: Sequence[torch.Tensor] | torch.Tensor, input: torch.Tensor, what: str,
                 begin: Callable[..., object]) -> None:
        """Every rank's ``input`` in its slot, block by block; ``outputs[r]`` (none: this
        rank receives nothing) <- rank ``r``'s."""
        src = as_bytes(input)
        n, B = src.numel(), self.block_bytes
        if self._carried(begin, n):
            begin(payload=src)
            self.collected(outputs, src)
            return
        if isinstance(outputs, torch.Tensor):
            dsts = list(as_bytes(outputs).split(n))
        else:
            dsts = [as_bytes(o) for o in outputs]
        if self.lib is not None:
            self._collect_native(src, dsts or [None] * self.L, n, what)
            return
        for start in range(0, n, B):
            stop = min(start + B, n)
            slots = self._next()
            slots[self.me, :stop - start].copy_(src[start:stop])
            self._swap(what)
            for r, dst in enumerate(dsts):
                dst[start:stop].copy_(src[start:stop] if r == self.me else slots[r, :stop - start])

    def collected(self, outputs: Sequence[torch.Tensor] | torch.Tensor, input: torch.Tensor) -> None:
        """``outputs[r]`` (one tensor: its ``r``-th piece) <- rank ``r``'s ``input`` of the
        call just exchanged in the call ring (this rank's from ``input`` itself)."""
        src = as_bytes(input)
        n = src.numel()
        if isinstance(outputs, torch.Tensor):  # one output: each rank's piece straight into it
            whole = as_bytes(outputs)
            for r in range(self.L):
                if r == self.me:
                    whole[r * n:(r + 1) * n].copy_(src)
                else:
                    self.calls.copy_out(whole, r, at=r * n, nbytes=n)
            return
        for r, dst in enumerate(outputs):
            if r == self.me:
                as_bytes(dst).copy_(src)
            else:
                self.calls.copy_out(dst, r)

    def broadcast(self, tensor: torch.Tensor, root: int, begin: Callable[..., object]) -> None:
        """Every rank's ``tensor`` <- the root's."""
        data = as_bytes(tensor)
        n, B = data.numel(), self.block_bytes
        if self._carried(begin, n):
            begin(payload=data if self.me == root else None)
            if self.me != root:
                self.calls.copy_out(data, root)
            return
        if self.lib is not None:
            mine = self.me == root
            self._collect_native(data if mine else None, [None if mine or r != root else data for r in range(self.L)],
                                 n, "broadcast")
            return
        for start in range(0, n, B):
            stop = min(start + B, n)
            slots = self._next()
            if self.me == root:
                slots[root, :stop - start].copy_(data[start:stop])
            self._swap("broadcast")
            if self.me != root:
                data[start:stop].copy_(slots[root, :stop - start])

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: str,
                       begin: Callable[..., object], same: bool = False) -> None:
        """``output`` <- the reduction over the ranks, in rank order, of their
        ``inputs[me]`` (``same``: every ``inputs[j]`` is one tensor, an all_reduce: one
        piece per rank per block, not ``L``). AVG as gloo's (floats) or NCCL's (integers)."""
        out = output.reshape(-1)
        size = out.element_size()
        sends = [t.reshape(-1) for t in inputs]
        n = out.numel()
        if self._carried(begin, n * size * (1 if same else self.L)):
            if same:
                begin(payload=sends[0])
            else:
                for j, send in enumerate(sends):
                    self.calls.copy_in(send, j * n * size)
                begin()
            at = 0 if same else self.me * n
            self._combined(out, self.calls.rows(out.dtype)[:, at:at + n], op)
        elif self._native_reduces(out, sends, op, same):
            self._reduce_native(out, sends[:1] if same else sends, op, same, -1,
                                f"{'all_reduce' if same else 'reduce_scatter'} {op}")
            return  # AVG divided in C
        else:
            per = (self.block_bytes // size) // (1 if same else self.L)
            combine = combining(op)
            for start in range(0, n, per):
                stop = min(start + per, n)
                m = stop - start
                slots = self._next().view(out.dtype)
                row = slots[self.me]
                for j in range(1 if same else self.L):
                    row[j * per:j * per + m].copy_(sends[j][start:stop])
                self._swap(f"{'all_reduce' if same else 'reduce_scatter'} {op}")
                at = 0 if same else self.me * per
                piece = out[start:stop]
                piece.copy_(slots[0, at:at + m])
                for r in range(1, self.L):
                    combine(piece, slots[r, at:at + m])
        if op == "AVG":
            average(out, self.L)

    def reduce(self, tensor: torch.Tensor, root: int, op: str, begin: Callable[..., object]) -> None:
        """The root's ``tensor`` <- the reduction over the ranks in rank order; the others'
        tensors are left as they were."""
        data = tensor.reshape(-1)
        n = data.numel()
        if self._carried(begin, n * data.element_size()):
            begin(payload=data)
            if self.me == root:
                self._combined(data, self.calls.rows(data.dtype)[:, :n], op)
        elif self._native_reduces(data, [data], op, True):
            self._reduce_native(data, [data], op, True, root, f"reduce {op}")
            return  # AVG divided in C
        else:
            per = self.block_bytes // data.element_size()
            combine = combining(op)
            for start in range(0, n, per):
                stop = min(start + per, n)
                m = stop - start
                slots = self._next().view(data.dtype)
                slots[self.me, :m].copy_(data[start:stop])
                self._swap(f"reduce {op}")
                if self.me == root:
                    piece = data[start:stop]
                    piece.copy_(slots[0, :m])
                    for r in range(1, self.L):
                        combine(piece, slots[r, :m])
        if op == "AVG" and self.me == root:
            average(data, self.L)

    def gather(self, outputs: Sequence[torch.Tensor] | None, input: torch.Tensor, root: int,
               begin: Callable[..., object]) -> None:
        """The root's ``outputs[r]`` <- rank ``r``'s ``input``."""
        self._collect(outputs if outputs is not None else [], input, "gather", begin)

    def scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor] | None, root: int,
                begin: Callable[..., object]) -> None:
        """``output`` <- the root's ``inputs[me]``."""
        dst = as_bytes(output)
        srcs = [as_bytes(t) for t in inputs] if inputs is not None else []
        n, per = dst.numel(), self.block_bytes // self.L
        if self._carried(begin, n * self.L):
            for j, src in enumerate(srcs):
                self.calls.copy_in(src, j * n)
            begin()
            self.calls.copy_out(dst, root, self.me * n)
            return
        for start in range(0, n, per):
            stop = min(start + per, n)
            m = stop - start
            slots = self._next()
            if self.me == root:
                for j, src in enumerate(srcs):
                    slots[root, j * per:j * per + m].copy_(src[start:stop])
            self._swap("scatter")
            dst[start:stop].copy_(slots[root, self.me * per:self.me * per + m])

    def all_to_all(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                   begin: Callable[..., object]) -> None:
        """``outputs[i]`` <- rank ``i``'s ``inputs[me]``; each pair may move a different
        number of bytes (uneven splits). The header carries each rank's count of blocks
        and whether its data fit the call ring (then, on every rank, that was the call)."""
        sends = [as_bytes(t) for t in inputs]
        recvs = [as_bytes(t) for t in outputs]
        small = self.calls.payload_bytes // self.L
        fits = all(t.numel() <= small for t in sends + recvs)
        if fits:
            for j, src in enumerate(sends):
                self.calls.copy_in(src, j * small)
        per = self.block_bytes // self.L
        mine = max([-(-t.numel() // per) for t in sends + recvs] + [0])
        begin(own=(mine, 0 if fits else 1))
        if not any(self.calls.owns(1)):  # every rank's data came with the headers
            for i, dst in enumerate(recvs):
                self.calls.copy_out(dst, i, self.me * small)
            return
        blocks = max(self.calls.owns(0))
        if self.lib is not None:
            self._exchange_native(recvs, sends, blocks, per)
            return
        for b in range(blocks):
            start = b * per
            slots = self._next()
            row = slots[self.me]
            for j, src in enumerate(sends):
                m = min(per, src.numel() - start)
                if m > 0:
                    row[j * per:j * per + m].copy_(src[start:start + m])
            self._swap("all_to_all")
            for i, dst in enumerate(recvs):
                m = min(per, dst.numel() - start)
                if m > 0:
                    dst[start:start + m].copy_(slots[i, self.me * per:self.me * per + m])

    def close(self) -> None:
        """Release the ring (no call may follow; the call ring is the reducer's)."""
        self._ring = None
        self.segment.close()
