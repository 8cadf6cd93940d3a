"""REALIGN: in-place ShiftRight / ShiftLeft (SHM-Learn-Dist Section 4) and FoldedLinear."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from shmtrain.models.realign import FoldedLinear, folded_mlp, helper_numel, shift_left, shift_right

SHAPES = [(1, 1), (1, 7), (7, 1), (2, 2), (3, 2), (2, 3), (9, 4), (4, 9), (17, 3), (30, 1), (1, 30), (12, 12)]


def _random_shapes(count: int, seed: int) -> list[tuple[int, int]]:
    gen = torch.Generator().manual_seed(seed)
    return [tuple(int(v) for v in torch.randint(1, 40, (2,), generator=gen)) for _ in range(count)]


@pytest.mark.parametrize("rows,cols", SHAPES + _random_shapes(12, seed=5))
def test_shift_right_then_left_restores_the_matrix_in_place(rows: int, cols: int) -> None:
    gen = torch.Generator().manual_seed(rows * 100 + cols)
    matrix = torch.randn(rows, cols, generator=gen)
    buffer = torch.full((rows * (cols + 1),), float("nan"))
    buffer[: rows * cols] = matrix.reshape(-1)
    address = buffer.data_ptr()
    # the helper the caller hands in is all the scratch there is besides one row buffer
    helper = torch.empty(helper_numel(rows, cols))
    assert helper.numel() <= rows * cols // 2, "the helper must stay below half the matrix"

    shift_right(buffer, rows, cols, helper=helper)
    expected = torch.cat([torch.ones(rows, 1), matrix], dim=1).reshape(-1)
    assert torch.equal(buffer, expected)
    shift_left(buffer, rows, cols, helper=helper)
    assert torch.equal(buffer[: rows * cols], matrix.reshape(-1))
    assert buffer.data_ptr() == address


@pytest.mark.parametrize("rows,cols", [(6, 5), (5, 5), (20, 3), (3, 20), (25, 1)])
def test_rows_may_move_in_any_order(rows: int, cols: int) -> None:
    """The helper removes the write-after-read race: any block schedule gives the result."""
    matrix = torch.randn(rows * cols)
    for seed in range(4):
        buffer = torch.empty(rows * (cols + 1))
        buffer[: rows * cols] = matrix
        shift_right(buffer, rows, cols, generator=torch.Generator().manual_seed(seed), fill=7.0)
        assert torch.equal(buffer.view(rows, cols + 1)[:, 1:].reshape(-1), matrix)
        assert torch.all(buffer.view(rows, cols + 1)[:, 0] == 7.0)
        shift_left(buffer, rows, cols, generator=torch.Generator().manual_seed(seed + 10))
        assert torch.equal(buffer[: rows * cols], matrix)


def test_a_naive_row_parallel_shift_would_lose_values() -> None:
    """Why the helper exists: moving row 0 before row 1 reads, without it, corrupts row 1."""
    rows, cols = 4, 4
    buffer = torch.arange(1.0, rows * cols + 1).repeat(1)
    buffer = torch.cat([buffer, torch.zeros(rows)])
    for i in range(rows):  # ascending, no helper: what concurrent blocks may do
        row = buffer[i * cols: i * cols + cols].clone()
        buffer[i * (cols + 1) + 1: i * (cols + 1) + 1 + cols] = row
        buffer[i * (cols + 1)] = 1
    assert not torch.equal(buffer.view(rows, cols + 1)[:, 1:].reshape(-1), torch.arange(1.0, 17))


def test_one_wave_helper_has_the_paper_layout() -> None:
    """Eqs. 4.2.3-4.2.5: helper[idx] = d_mat[j + i*cols], i = floor((sqrt(1+8idx)-1)/2)+1."""
    rows, cols = 6, 8
    matrix = torch.randn(rows * cols)
    buffer = torch.empty(rows * (cols + 1))
    buffer[: rows * cols] = matrix
    helper = torch.empty(rows * (rows - 1) // 2)  # eq. 4.2.1's size
    assert helper_numel(rows, cols) == helper.numel()
    shift_right(buffer, rows, cols, helper=helper)
    for idx in range(helper.numel()):
        i = math.floor(0.5 * (math.sqrt(1 + 8 * idx) - 1)) + 1
        j = idx - i * (i - 1) // 2
        assert helper[idx] == matrix[j + i * cols]


def test_bad_buffers_are_rejected() -> None:
    with pytest.raises(ValueError, match="rows\\*\\(cols\\+1\\)"):
        shift_right(torch.zeros(12), 3, 4)
    with pytest.raises(ValueError, match=">= 1"):
        shift_left(torch.zeros(12), 0, 4)
    with pytest.raises(ValueError, match="contiguous 1-D"):
        shift_right(torch.zeros(4, 5), 4, 4)


@pytest.mark.parametrize("shape", [(5, 7), (1, 7), (3, 2, 7), (64, 7)])
def test_folded_linear_matches_nn_linear(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(7, 4)
    folded = FoldedLinear.from_linear(linear)
    x1 = torch.randn(*shape, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    upstream = torch.randn(*shape[:-1], 4)
    y1, y2 = linear(x1), folded(x2)
    assert torch.allclose(y1, y2, rtol=1e-6, atol=1e-6)
    (y1 * upstream).sum().backward()
    (y2 * upstream).sum().backward()
    assert torch.allclose(x1.grad, x2.grad, rtol=1e-6, atol=1e-6)
    assert torch.allclose(linear.weight.grad, folded.weight.grad[:, 1:], rtol=1e-5, atol=1e-6)
    assert torch.allclose(linear.bias.grad, folded.weight.grad[:, 0], rtol=1e-5, atol=1e-6)
    assert torch.equal(folded.bias_column, folded.weight[:, 0])


def test_folded_linear_gradcheck_in_double() -> None:
    layer = FoldedLinear(3, 2).double()
    x = torch.randn(4, 3, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (x,))


def test_folded_mlp_trains_like_the_unfolded_one() -> None:
    torch.manual_seed(1)
    model = folded_mlp((1, 8, 8), 10)
    reference = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    with torch.no_grad():
        reference[1].weight.copy_(model[1].matrix)
        reference[1].bias.copy_(model[1].bias_column)
        reference[3].weight.copy_(model[3].matrix)
        reference[3].bias.copy_(model[3].bias_column)
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    for net in (model, reference):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(5):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
    assert torch.allclose(model[3].matrix, reference[3].weight, atol=1e-5)
    assert torch.allclose(model[1].bias_column, reference[1].bias, atol=1e-5)


def test_folded_mlp_is_in_the_model_registry() -> None:
    from shmtrain.models import build_model

    model = build_model("folded_mlp", (1, 8, 8), 10)
    assert any(isinstance(m, FoldedLinear) for m in model.modules())
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)
