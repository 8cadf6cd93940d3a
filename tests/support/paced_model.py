"""A small model whose forward pass takes at least ``delay`` seconds (``--model
support.paced_model:PacedMLP``): tests that need a run of a known length (a host lost and
started again while the others train) without the machine's load setting it."""

from __future__ import annotations

import time

import torch
from torch import nn


class PacedMLP(nn.Module):
    """digits' MLP (64 -> 32 -> 10) that sleeps ``delay`` seconds per forward pass."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, delay: float = 0.02) -> None:
        super().__init__()
        features = 1
        for size in input_shape:
            features *= size
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, num_classes))
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay)
        return self.net(x)
