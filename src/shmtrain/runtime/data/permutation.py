"""A seeded permutation of ``range(n)`` computed per index, in O(1) memory.

A data set of 10^9 lazy items must not cost the launcher or a worker a list of 10^9
indices (``torch.randperm(n)`` holds 8 bytes per item, its ``tolist()`` about 36), nor
start-up time that grows with ``n``. :func:`permute` maps positions to their image under
a seeded bijection of ``[0, n)`` without holding the permutation: a balanced Feistel
network (four rounds of a 64-bit multiply-xorshift mix, Luby-Rackoff) on the smallest
domain ``4^h >= n``, with cycle-walking (an image ``>= n`` is mapped again until it falls
in ``[0, n)``; the domain is less than ``4 n``, so under four rounds on average). Being a
bijection, a slice of positions never repeats an index, which is what exact sharding
needs (``runtime/data/tensors.py``, :class:`~shmtrain.runtime.data.tensors.ShardSampler`).

:class:`PermutedRange` is a slice of such a permutation as a read-only sequence of ints,
what :class:`torch.utils.data.Subset` takes as its ``indices``: the held-out split of a
``--data module:callable`` data set (``runtime/data/user_data.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import numpy as np
import torch

_MASK64 = (1 << 64) - 1
_ROUNDS = 4


def _round_keys(n: int, seed: int) -> np.ndarray:
    """The rounds' 64-bit keys of the permutation of ``range(n)`` seeded ``seed``."""
    state = (seed * 0x9E3779B97F4A7C15 + n * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    keys = []
    for _ in range(_ROUNDS):  # splitmix64
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        keys.append(z ^ (z >> 31))
    return np.array(keys, dtype=np.uint64)


def _mix(right: np.ndarray, key: np.uint64, mask: np.uint64) -> np.ndarray:
    z = (right ^ key) * np.uint64(0xBF58476D1CE4E5B9)  # uint64 arrays wrap, as intended
    z = (z ^ (z >> np.uint64(31))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(29))) & mask


def _feistel(x: np.ndarray, half: int, keys: np.ndarray) -> np.ndarray:
    mask = np.uint64((1 << half) - 1)
    left, right = x >> np.uint64(half), x & mask
    for key in keys:
        left, right = right, left ^ _mix(right, key, mask)
    return (left << np.uint64(half)) | right


def permute(positions: np.ndarray | torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """The images of ``positions`` (ints in ``[0, n)``) under the permutation of
    ``range(n)`` seeded ``seed``, as an int64 tensor; the work and memory are those of
    ``positions``, whatever ``n``."""
    if n < 1:
        raise ValueError(f"a permutation of range({n}): n must be at least 1")
    x = np.asarray(positions, dtype=np.int64)
    if x.size and (int(x.min()) < 0 or int(x.max()) >= n):
        raise IndexError(f"positions outside range({n})")
    if n == 1:
        return torch.zeros(x.shape, dtype=torch.int64)
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    keys = _round_keys(n, seed)
    out = x.astype(np.uint64)
    walking = np.ones(out.shape, dtype=bool)
    while walking.any():  # cycle-walking: map again what fell outside [0, n)
        out[walking] = _feistel(out[walking], half, keys)
        walking = out >= np.uint64(n)
    return torch.from_numpy(out.astype(np.int64))


class PermutedRange(Sequence[int]):
    """Positions ``start .. stop - 1`` of the permutation of ``range(n)`` seeded ``seed``,
    as a sequence of ints computed on access (O(1) memory)."""

    def __init__(self, n: int, seed: int, start: int = 0, stop: int | None = None) -> None:
        stop = n if stop is None else stop
        if not 0 <= start <= stop <= n:
            raise ValueError(f"positions {start}..{stop} are not inside range({n})")
        self.n, self.seed, self.start, self.stop = n, seed, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            span = range(self.start, self.stop)[i]  # a range: nothing allocated but the slice
            return permute(np.arange(span.start, span.stop, span.step), self.n, self.seed).tolist()
        size = len(self)
        if not -size <= i < size:
            raise IndexError(f"index {i} out of range for {size} items")
        return int(permute(np.array([self.start + (i % size)]), self.n, self.seed)[0])

    def __iter__(self):  # in blocks: a plain loop over 10^9 items would still be O(1) memory
        for begin in range(self.start, self.stop, 65536):
            yield from permute(np.arange(begin, min(begin + 65536, self.stop)), self.n, self.seed).tolist()

    def __repr__(self) -> str:
        return f"PermutedRange(n={self.n}, seed={self.seed}, start={self.start}, stop={self.stop})"
