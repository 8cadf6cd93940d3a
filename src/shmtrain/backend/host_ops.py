"""The ``shm`` backend's collectives other than the sum, inside one host, through a ring of
shared blocks.

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

Each method takes contiguous tensors (the backend makes copies of strided ones) and runs on
the group's reduction thread or the caller's (:class:`~shmtrain.backend.reducer.HostReducer`
decides, and keeps the calls of every op in the order they were issued).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from shmtrain.backend.reduce_ops import average
from shmtrain.fabric.shm.host import HostGroup

RING = 2
#: bytes of a rank's slot: 1 MiB (the pipelined allreduce's block on the Python path)
BLOCK_BYTES = 1 << 20


def _combine(op: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``out <- out (op) row`` in place, for the reductions other than the sum's pipeline."""
    return {"SUM": torch.Tensor.add_, "AVG": torch.Tensor.add_, "MAX": _max, "MIN": _min,
            "PRODUCT": torch.Tensor.mul_, "BAND": torch.Tensor.bitwise_and_, "BOR": torch.Tensor.bitwise_or_,
            "BXOR": torch.Tensor.bitwise_xor_}[op]


def _max(out: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    return torch.maximum(out, row, out=out)


def _min(out: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    return torch.minimum(out, row, out=out)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat uint8 view (no copy)."""
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


class HostOps:
    """The ring and the ops of one group's host (module docstring).

    Args:
        host: the host's workers of the group.
        spin: whether waits spin before sleeping (the reducer's rule).
        block_bytes: bytes of one rank's slot.
        tag: name fragment of the segment and the channel.
    """

    def __init__(self, host: HostGroup, spin: bool | None, block_bytes: int = BLOCK_BYTES,
                 tag: str = "pg-ops") -> None:
        self.host, self.spin, self.block_bytes = host, spin, block_bytes
        self.L, self.me = host.local_world, host.local_rank
        self.segment = host.allocate(tag, RING * self.L * block_bytes)
        self._ring = self.segment.tensor(torch.uint8, 0, RING * self.L * block_bytes).view(RING, self.L, block_bytes)
        self._channel = host.channel(f"{tag}.posted")
        self.blocks = 0  # blocks exchanged so far (the sequence number of the last one)
        self.phase = ""  # what a failed wait was waiting for (errors name it)

    # -- the one primitive ----------------------------------------------------------
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

    # -- ops ------------------------------------------------------------------------
    def all_gather(self, outputs: Sequence[torch.Tensor], input: torch.Tensor) -> None:
        """``outputs[r]`` <- rank ``r``'s ``input`` (every rank the same number of bytes)."""
        self._collect(outputs, input, "all_gather")

    def _collect(self, outputs: Sequence[torch.Tensor], input: torch.Tensor, what: str) -> None:
        """Every rank's ``input`` in its slot, block by block; ``outputs[r]`` (none: this
        rank receives nothing) <- rank ``r``'s."""
        src = as_bytes(input)
        dsts = [as_bytes(o) for o in outputs]
        n, B = src.numel(), self.block_bytes
        for start in range(0, n, B):
            stop = min(start + B, n)
            slots = self._next()
            slots[self.me, :stop - start].copy_(src[start:stop])
            self._swap(what)
            for r, dst in enumerate(dsts):
                dst[start:stop].copy_(src[start:stop] if r == self.me else slots[r, :stop - start])

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        """Every rank's ``tensor`` <- the root's."""
        data = as_bytes(tensor)
        n, B = data.numel(), self.block_bytes
        for start in range(0, n, B):
            stop = min(start + B, n)
            slots = self._next()
            if self.me == root:
                slots[root, :stop - start].copy_(data[start:stop])
            self._swap("broadcast")
            if self.me != root:
                data[start:stop].copy_(slots[root, :stop - start])

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: str,
                       same: bool = False) -> None:
        """``output`` <- the reduction over the ranks, in rank order, of their
        ``inputs[me]`` (``same``: every ``inputs[j]`` is one tensor, an all_reduce: one
        piece per rank per block, not ``L``). AVG as gloo's (floats) or NCCL's (integers)."""
        out = output.reshape(-1)
        size = out.element_size()
        per = (self.block_bytes // size) // (1 if same else self.L)
        combine = _combine(op)
        sends = [t.reshape(-1) for t in inputs]
        n = out.numel()
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

    def reduce(self, tensor: torch.Tensor, root: int, op: str) -> None:
        """The root's ``tensor`` <- the reduction over the ranks in rank order; the others'
        tensors are left as they were."""
        data = tensor.reshape(-1)
        per = self.block_bytes // data.element_size()
        combine = _combine(op)
        n = data.numel()
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

    def gather(self, outputs: Sequence[torch.Tensor] | None, input: torch.Tensor, root: int) -> None:
        """The root's ``outputs[r]`` <- rank ``r``'s ``input``."""
        self._collect(outputs if outputs is not None else [], input, "gather")

    def scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor] | None, root: int) -> None:
        """``output`` <- the root's ``inputs[me]``."""
        dst = as_bytes(output)
        srcs = [as_bytes(t) for t in inputs] if inputs is not None else []
        n, per = dst.numel(), self.block_bytes // self.L
        for start in range(0, n, per):
            stop = min(start + per, n)
            m = stop - start
            slots = self._next()
            if self.me == root:
                for j, src in enumerate(srcs):
                    slots[root, j * per:j * per + m].copy_(src[start:stop])
            self._swap("scatter")
            dst[start:stop].copy_(slots[root, self.me * per:self.me * per + m])

    def all_to_all(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
        """``outputs[i]`` <- rank ``i``'s ``inputs[me]``; each pair may move a different
        number of bytes (uneven splits)."""
        sends = [as_bytes(t) for t in inputs]
        recvs = [as_bytes(t) for t in outputs]
        per = self.block_bytes // self.L
        mine = max([-(-t.numel() // per) for t in sends + recvs] + [0])
        slots = self._next().view(torch.int64)  # first block: every rank's count of blocks
        slots[self.me, 0] = mine
        self._swap("all_to_all")
        blocks = int(slots[:, 0].max())
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
        """Release the ring (no call may follow)."""
        self._ring = None
        self.segment.close()
