"""Models for ``--model support.odd_models:<name>`` in tests/runtime/data/test_odd_inputs.py."""

from __future__ import annotations

import math

from torch import nn


def fixed(input_shape: tuple[int, ...], outputs: int = 3) -> nn.Module:
    """A linear model with ``outputs`` scores whatever the data's class count."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), outputs))


class _NanAfter(nn.Module):
    """A linear model whose output turns NaN at its ``after``-th forward on worker ``rank``."""

    def __init__(self, inputs: int, outputs: int, rank: int, after: int) -> None:
        super().__init__()
        import os

        self.body = nn.Sequential(nn.Flatten(), nn.Linear(inputs, outputs))
        self.poisoned = int(os.environ.get("RANK", "0")) == rank
        self.after, self.calls = after, 0

    def forward(self, x):
        out = self.body(x)
        if self.training and self.poisoned:
            self.calls += 1
            if self.calls >= self.after:
                out = out * float("nan")
        return out


def nan_loss(input_shape: tuple[int, ...], num_classes: int = 10, rank: int = 1, after: int = 5) -> nn.Module:
    """A linear model whose training loss on worker ``rank`` is NaN from its ``after``-th
    iteration on (the other ranks' stays finite)."""
    return _NanAfter(math.prod(input_shape), num_classes, rank, after)


class _NanGradAt(_NanAfter):
    """A linear model whose gradient (not its loss) is NaN at its ``after``-th backward on
    worker ``rank``, once."""

    def forward(self, x):
        out = self.body(x)
        if self.training and self.poisoned:
            self.calls += 1
            if self.calls == self.after:
                out.register_hook(lambda grad: grad * float("nan"))
        return out


def nan_gradient(input_shape: tuple[int, ...], num_classes: int = 10, rank: int = 1, after: int = 5) -> nn.Module:
    """A linear model whose gradient on worker ``rank`` is NaN at its ``after``-th iteration
    (its loss there stays finite; the weights it updates do not)."""
    return _NanGradAt(math.prod(input_shape), num_classes, rank, after)


def loud(input_shape: tuple[int, ...], num_classes: int = 10, scale: float = 1e6) -> nn.Module:
    """A linear model whose scores are ``scale`` times a plain one's: finite in float32,
    past float16's range (65504) under ``--amp fp16``."""

    class Loud(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))

        def forward(self, x):
            return self.body(x) * scale

    return Loud()
