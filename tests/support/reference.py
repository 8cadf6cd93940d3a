"""Single-process references the data-parallel tests compare against."""

from __future__ import annotations

import torch
from torch import nn


def tiny_model(seed: int = 0) -> nn.Module:
    """A conv layer and two linear layers of different sizes; no batch norm."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 32), nn.ReLU(), nn.Linear(32, 10),
    )


def batches(steps: int, global_batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``steps`` union batches of ``global_batch`` 1x8x8 inputs and labels of 10 classes, seeded."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((steps * global_batch, 1, 8, 8), generator=gen)
    y = torch.randint(0, 10, (steps * global_batch,), generator=gen)
    return x, y


def worker_batch(x: torch.Tensor, y: torch.Tensor, step: int, rank: int, batch: int, world: int):
    """Rank ``rank``'s share (``batch`` items) of step ``step``'s union batch in :func:`batches`'s order."""
    start = step * batch * world + rank * batch
    return x[start : start + batch], y[start : start + batch]


def flat_params(model: nn.Module) -> torch.Tensor:
    """A copy of the model's parameters, flattened into one vector."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def single_process_sgd(
    steps: int, batch: int, world: int, lr=0.1, momentum=0.9, weight_decay=1e-3
) -> list[torch.Tensor]:
    """Weights after every step of plain SGD on the union of the workers' batches."""
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    x, y = batches(steps, batch * world)
    loss_fn = nn.CrossEntropyLoss()
    history = []
    for step in range(steps):
        xs, ys = (
            x[step * batch * world : (step + 1) * batch * world],
            y[step * batch * world : (step + 1) * batch * world],
        )
        opt.zero_grad()
        loss_fn(model(xs), ys).backward()
        opt.step()
        history.append(flat_params(model))
    return history


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||``."""
    return float((a - b).norm() / b.norm())


def ddp_step(
    model: nn.Module, opt: torch.optim.Optimizer, xs: torch.Tensor, ys: torch.Tensor, clip: float | None = None
) -> bool:
    """One step of a plain DDP loop (zero_grad, forward, backward, clip_grad_norm_, step);
    whether the clip bit (the gradient's norm was above ``clip``)."""
    opt.zero_grad()
    nn.CrossEntropyLoss()(model(xs), ys).backward()
    clipped = clip is not None and bool(torch.nn.utils.clip_grad_norm_(model.parameters(), clip) > clip)
    opt.step()
    return clipped
