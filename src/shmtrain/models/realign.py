"""In-place memory realignment (REALIGN) and a fully connected layer with its bias folded
into the weight matrix: SHM-Learn-Dist Section 4.

``shift_right`` turns a row-major ``rows x cols`` matrix into ``rows x (cols + 1)`` with a
column of ones in front, in the same buffer (Figs. 4.2.1-4.2.2)::

    [a0, a1, a2, a3] -> [1, a0, a1, 1, a2, a3]

and ``shift_left`` drops the first column again (Figs. 4.3.1-4.3.2). Element ``(i, j)``
moves by ``i + 1`` places. The paper's GPU kernels move every row at once (one thread
block per row, reading its row into block-shared memory, then writing it); a row's new
place overlaps the start of the next row (ShiftRight) or the end of the previous one
(ShiftLeft), so a row may be overwritten before its block has read it (the
write-after-read race). The paper first copies exactly those values into a helper
array of ``rows * (rows - 1) / 2`` elements (eqs. 4.2.1-4.2.5), then lets every block
read them from there. This module does the same, on the CPU with one row buffer
(the block's shared memory) and rows taken in any order (``generator`` shuffles them
to show that no order is needed), and it bounds the helper: when the paper's helper
would exceed half the matrix (rows > cols + 1), rows are moved in *waves* (descending
for ShiftRight, ascending for ShiftLeft, so no wave can damage one not yet moved), each
wave with its own helper. The helper of a one-wave shift has the paper's layout: entry
``idx`` holds element ``(i, j)`` with ``idx = i (i - 1) / 2 + j``.

:class:`FoldedLinear` keeps ``W_aug = [b | W]`` (``out x (in + 1)``): the forward pass is
one matrix product ``[1 | x] @ W_aug^T`` (ShiftRight on the input), the weight and bias
gradients are one product ``D^T @ [1 | x]``, and the input gradient is ``D @ W_aug`` with
its first column dropped in place (ShiftLeft), so no separate bias add or bias
gradient reduction is needed.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import nn

from shmtrain.models.registry import register_model


def _check(buffer: torch.Tensor, rows: int, cols: int) -> None:
    if rows < 1 or cols < 1:
        raise ValueError(f"matrix shape {rows}x{cols}: rows and cols must be >= 1")
    if buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError("the buffer must be a contiguous 1-D tensor (the matrix in row-major order)")
    if buffer.numel() < rows * (cols + 1):
        raise ValueError(
            f"a {rows}x{cols} matrix needs a buffer of rows*(cols+1) = {rows * (cols + 1)} "
            f"elements to be realigned in place; this one holds {buffer.numel()}"
        )


def _damage_right(a: int, b: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``a+1 .. b-1`` of a ShiftRight wave ``[a, b)``: the column range ``[lo, hi)`` of
    each that earlier rows of the wave overwrite (rows ``r < i`` write ``[a(c+1), i(c+1))``)."""
    i = np.arange(a + 1, b, dtype=np.int64)
    lo = np.maximum(0, a * (cols + 1) - i * cols)
    hi = np.minimum(cols, i)
    return lo, np.maximum(hi, lo)


def _damage_left(a: int, b: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``a .. b-2`` of a ShiftLeft wave ``[a, b)``: the value columns ``[lo, hi)`` of each
    that later rows of the wave overwrite (rows ``s > r`` write ``[(r+1)c, bc)``)."""
    r = np.arange(a, b - 1, dtype=np.int64)
    lo = np.maximum(0, cols - r - 1)
    hi = np.minimum(cols, (b - r) * cols - r - 1)
    return lo, np.maximum(hi, lo)


def _helper_size(damage, a: int, b: int, cols: int) -> int:
    lo, hi = damage(a, b, cols)
    return int((hi - lo).sum())


def _waves(rows: int, cols: int, cap: int, right: bool) -> list[tuple[int, int]]:
    """Split the rows into waves whose helper fits ``cap`` elements (one wave if it can)."""
    damage = _damage_right if right else _damage_left
    waves = []
    if right:
        b = rows
        while b > 0:
            lo, hi = 0, b - 1  # smallest a in [0, b-1] with helper(a, b) <= cap
            while lo < hi:
                mid = (lo + hi) // 2
                if _helper_size(damage, mid, b, cols) <= cap:
                    hi = mid
                else:
                    lo = mid + 1
            waves.append((lo, b))
            b = lo
    else:
        a = 0
        while a < rows:
            lo, hi = a + 1, rows  # largest b in [a+1, rows] with helper(a, b) <= cap
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if _helper_size(damage, a, mid, cols) <= cap:
                    lo = mid
                else:
                    hi = mid - 1
            waves.append((a, lo))
            a = lo
    return waves


@lru_cache(maxsize=256)
def _plan(rows: int, cols: int, cap: int, right: bool) -> tuple[tuple[int, int, list, list, list], ...]:
    """Per wave: ``(a, b, lo, hi, offsets)`` as Python lists (cheap to slice with)."""
    damage = _damage_right if right else _damage_left
    plan = []
    for a, b in _waves(rows, cols, cap, right):
        lo, hi = damage(a, b, cols)
        offsets = np.concatenate(([0], np.cumsum(hi - lo)))
        plan.append((a, b, lo.tolist(), hi.tolist(), offsets.tolist()))
    return tuple(plan)


@lru_cache(maxsize=256)
def helper_numel(rows: int, cols: int, limit: int | None = None) -> int:
    """Elements of the helper array ShiftRight and ShiftLeft need for a ``rows x cols`` matrix.

    Eq. 4.2.1's ``rows (rows - 1) / 2`` when that is at most ``limit`` (default: half the
    matrix, ``rows * cols // 2``); otherwise the largest wave's helper under ``limit``.
    """
    cap = rows * cols // 2 if limit is None else limit
    sizes = [0]
    for right, damage in ((True, _damage_right), (False, _damage_left)):
        sizes += [_helper_size(damage, a, b, cols) for a, b in _waves(rows, cols, cap, right)]
    return max(sizes)


def _arrays(buffer: torch.Tensor) -> Any:
    """The buffer as an array that slices cheaply: numpy on the CPU, the tensor elsewhere."""
    if buffer.device.type == "cpu" and buffer.dtype not in (torch.bfloat16,):
        return buffer.detach().numpy()
    return buffer.detach()


def _helper_array(buffer: torch.Tensor, helper: torch.Tensor | None, need: int) -> tuple[Any, int]:
    if helper is None:
        cap = need
        array = np.empty(need,
                         dtype=_arrays(buffer[:1]).dtype) if buffer.device.type == "cpu" else buffer.new_empty(need)
        return array, cap
    if helper.dim() != 1 or not helper.is_contiguous() or helper.dtype != buffer.dtype:
        raise ValueError("helper must be a contiguous 1-D tensor of the buffer's dtype")
    return _arrays(helper), helper.numel()


def _order(a: int, b: int, generator: torch.Generator | None) -> list[int]:
    if generator is None:
        return list(range(a, b))
    return (torch.randperm(b - a, generator=generator) + a).tolist()


def shift_right(
    buffer: torch.Tensor,
    rows: int,
    cols: int,
    *,
    fill: float = 1.0,
    helper: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> None:
    """ShiftRight in place: ``rows x cols`` -> ``rows x (cols + 1)`` with ``fill`` in column 0.

    SHM-Learn-Dist Section 4.2: populate the helper with the values a row-parallel shift
    would overwrite (``ShiftRight_PopulateHelper``), then move each row through a row
    buffer, reading those values from the helper (``ReAlignMemory_ShiftRight``).

    Args:
        buffer: contiguous 1-D tensor of at least ``rows * (cols + 1)`` elements whose first
            ``rows * cols`` hold the matrix row-major.
        rows, cols: the matrix shape before the shift.
        fill: the value of the new first column (1 folds a bias into a product).
        helper: scratch for the endangered values (default: allocated, at most half the
            matrix); its size bounds each wave.
        generator: move the rows of a wave in a random order (any order is correct).
    """
    _check(buffer, rows, cols)
    data = _arrays(buffer)
    need = helper_numel(rows, cols) if helper is None else None
    help_array, cap = _helper_array(buffer, helper, need or 0)
    row = data[:cols].copy() if isinstance(data, np.ndarray) else buffer.new_empty(cols)
    for a, b, lo, hi, offsets in _plan(rows, cols, cap, True):
        for k, i in enumerate(range(a + 1, b)):  # phase 1: save what earlier rows overwrite
            help_array[offsets[k]: offsets[k + 1]] = data[i * cols + lo[k]: i * cols + hi[k]]
        for i in _order(a, b, generator):  # phase 2: each row is an independent block
            start = i * cols
            row[:] = data[start: start + cols]
            if i > a:
                k = i - a - 1
                row[lo[k]: hi[k]] = help_array[offsets[k]: offsets[k + 1]]
            dest = i * (cols + 1)
            data[dest + 1: dest + 1 + cols] = row
            data[dest] = fill


def shift_left(
    buffer: torch.Tensor,
    rows: int,
    cols: int,
    *,
    helper: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> None:
    """ShiftLeft in place: ``rows x (cols + 1)`` -> ``rows x cols``, dropping column 0.

    SHM-Learn-Dist Section 4.3, the inverse of :func:`shift_right`; ``cols`` is the width
    *after* the shift. Arguments as for :func:`shift_right`.
    """
    _check(buffer, rows, cols)
    data = _arrays(buffer)
    need = helper_numel(rows, cols) if helper is None else None
    help_array, cap = _helper_array(buffer, helper, need or 0)
    row = data[:cols].copy() if isinstance(data, np.ndarray) else buffer.new_empty(cols)
    for a, b, lo, hi, offsets in _plan(rows, cols, cap, False):
        for k, r in enumerate(range(a, b - 1)):  # phase 1: save what later rows overwrite
            src = r * (cols + 1) + 1
            help_array[offsets[k]: offsets[k + 1]] = data[src + lo[k]: src + hi[k]]
        for r in _order(a, b, generator):  # phase 2
            src = r * (cols + 1) + 1
            row[:] = data[src: src + cols]
            if r < b - 1:
                k = r - a
                row[lo[k]: hi[k]] = help_array[offsets[k]: offsets[k + 1]]
            data[r * cols: r * cols + cols] = row


class _FoldedLinearFunction(torch.autograd.Function):
    """Forward ``[1 | x] W_aug^T``; backward ``D^T [1 | x]`` and ShiftLeft(``D W_aug``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        n, m_in = x.shape
        buffer = x.new_empty(n * (m_in + 1))
        buffer[: n * m_in].copy_(x.reshape(-1))
        shift_right(buffer, n, m_in)
        augmented = buffer.view(n, m_in + 1)
        ctx.save_for_backward(augmented, weight)
        return augmented @ weight.t()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # noqa: ANN001, ANN205
        augmented, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = grad_out.t() @ augmented  # weights and bias in one product
        if ctx.needs_input_grad[0]:
            n, m_in = augmented.shape[0], augmented.shape[1] - 1
            full = (grad_out @ weight).reshape(-1)  # column 0 is the bias column's, dropped
            shift_left(full, n, m_in)
            grad_x = full[: n * m_in].view(n, m_in)
        return grad_x, grad_weight


class FoldedLinear(nn.Module):
    """A fully connected layer whose bias is column 0 of its weight matrix.

    ``y = x W^T + b`` computed as ``[1 | x] @ weight^T`` with ``weight = [b | W]`` of shape
    ``out_features x (in_features + 1)`` (SHM-Learn-Dist Section 4; the bias folding of
    its reference [3]). Initialised like :class:`torch.nn.Linear`.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise ValueError(f"FoldedLinear({in_features}, {out_features}): sizes must be >= 1")
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features + 1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            matrix = torch.empty(self.out_features, self.in_features)
            nn.init.kaiming_uniform_(matrix, a=math.sqrt(5))
            bound = 1 / math.sqrt(self.in_features)
            self.weight[:, 1:].copy_(matrix)
            self.weight[:, 0].uniform_(-bound, bound)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> FoldedLinear:
        """A FoldedLinear computing the same function as ``linear`` (bias 0 if it has none)."""
        layer = cls(linear.in_features, linear.out_features)
        with torch.no_grad():
            layer.weight[:, 1:].copy_(linear.weight)
            layer.weight[:, 0].copy_(linear.bias if linear.bias is not None else 0.0)
        return layer

    @property
    def bias_column(self) -> torch.Tensor:
        """The bias (a view of column 0 of ``weight``)."""
        return self.weight[:, 0]

    @property
    def matrix(self) -> torch.Tensor:
        """The weight matrix without the bias (a view)."""
        return self.weight[:, 1:]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"FoldedLinear expects {self.in_features} input features, got {x.shape[-1]}")
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] == 0:
            return x.new_empty(*lead, self.out_features)
        return _FoldedLinearFunction.apply(flat, self.weight).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias folded"


def folded_mlp(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The registry's ``mlp`` built on FoldedLinear: flatten, 64 hidden units, ReLU (REALIGN)."""
    return nn.Sequential(
        nn.Flatten(), FoldedLinear(math.prod(input_shape), 64), nn.ReLU(), FoldedLinear(64, num_classes)
    )


register_model("folded_mlp", folded_mlp)
