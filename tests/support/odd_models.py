"""Models for ``--model support.odd_models:<name>`` in tests/runtime/data/test_odd_inputs.py."""

from __future__ import annotations

import math

from torch import nn


def fixed(input_shape: tuple[int, ...], outputs: int = 3) -> nn.Module:
    """A linear model with ``outputs`` scores whatever the data's class count."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), outputs))
