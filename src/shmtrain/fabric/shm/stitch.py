"""Stitched views: one contiguous tensor whose pieces are pages of other shared slots.

The shared-memory allreduce reduces chunk ``r`` of the buffer in place, inside rank
``r``'s own slot, so the reduced buffer is scattered: chunk 0 in slot 0, chunk 1 in
slot 1, ... A stitched view maps those pieces again, back to back, into one reserved
range of this process's address space (``mmap`` with ``MAP_FIXED`` over the same
shared pages), so the optimizer reads the whole result as one tensor without a copy.
Piece offsets and all but the last length must be multiples of the page size.
"""

from __future__ import annotations

import ctypes
import mmap as _mmap
from collections.abc import Sequence

import torch

from shmtrain.fabric.shm.segment import SharedSegment

PAGE = _mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS = 0x01, 0x02, 0x10, 0x20
_PROT_RW = _mmap.PROT_READ | _mmap.PROT_WRITE


def _round_up(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


class StitchedView:
    """A tensor of ``numel`` elements made of ``pieces`` = [(segment byte offset, bytes)].

    Keep this object alive as long as the tensor is used.
    """

    def __init__(
        self,
        segment: SharedSegment,
        pieces: Sequence[tuple[int, int]],
        dtype: torch.dtype,
        numel: int,
    ) -> None:
        if segment.fd < 0:
            raise ValueError(f"segment {segment.name!r} is closed; cannot stitch a view of it")
        total = sum(length for _, length in pieces)
        self.length = _round_up(max(total, 1))
        base = _libc.mmap(None, self.length, _PROT_RW, _MAP_PRIVATE | _MAP_ANONYMOUS, -1, 0)
        if base in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), "mmap: cannot reserve address space for a stitched view")
        self.base = base
        cursor = 0
        for offset, length in pieces:
            if length == 0:
                continue
            if offset % PAGE or cursor % PAGE:
                raise ValueError(f"stitched piece at byte {offset} (+{cursor}) is not page aligned")
            span = min(_round_up(length), segment.nbytes - offset)
            got = _libc.mmap(base + cursor, span, _PROT_RW, _MAP_SHARED | _MAP_FIXED, segment.fd, offset)
            if got != base + cursor:
                raise OSError(ctypes.get_errno(), "mmap: cannot map a piece of a stitched view")
            cursor += length
        itemsize = torch.empty((), dtype=dtype).element_size()
        raw = (ctypes.c_char * self.length).from_address(base)
        self._raw = raw
        if numel * itemsize > self.length:
            raise ValueError(f"stitched view of {total} bytes cannot hold {numel} x {itemsize} bytes")
        self.tensor = torch.frombuffer(raw, dtype=dtype, count=numel) if numel else torch.empty(0, dtype=dtype)

    def close(self) -> None:
        """Unmap the view; the tensor must not be used afterwards."""
        if self.base:
            del self.tensor, self._raw
            _libc.munmap(self.base, self.length)
            self.base = 0
