"""Data sets, models and loss functions of the task tests (``--data``, ``--model`` and ``--task``
module:callable)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

FEATURES = 6


def _xy(samples: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=gen)
    w = torch.linspace(-1.0, 1.0, FEATURES)
    return x, x @ w + 0.1 * torch.randn(samples, generator=gen)


def regression(samples: int = 160) -> TensorDataset:
    """``(x, y)`` items: six features, one real target."""
    return TensorDataset(*_xy(samples))


class DictItems(Dataset):
    """Items ``{"a": x[:2], "b": x[2:], "target": y}``: a model of two inputs."""

    def __init__(self, samples: int) -> None:
        self.x, self.y = _xy(samples)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"a": self.x[i, :2], "b": self.x[i, 2:], "target": self.y[i]}


def dict_regression(samples: int = 160) -> DictItems:
    """The regression of :func:`regression` as dict batches (:class:`DictItems`)."""
    return DictItems(samples)


class Regressor(nn.Module):
    """A small MLP from the input's features to ``num_classes`` outputs (the target's size)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(input_shape[0], 16), nn.Tanh(), nn.Linear(16, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TwoInputs(nn.Module):
    """``forward(a, b)``: two inputs, keyword arguments of a dict batch."""

    def __init__(self, num_classes: int = 1) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 8), nn.Linear(FEATURES - 2, 8)
        self.head = nn.Linear(8, num_classes)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.a(a) + self.b(b)))


def mse_and_mae(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """A plain loss function (``--task support.task_data:mse_and_mae``): the mean squared
    error of ``(x, y)`` batches, and the mean absolute error as a metric."""
    x, y = batch
    output = model(x).reshape(y.shape)
    return torch.nn.functional.mse_loss(output, y), {"mae": (output - y).abs().mean()}


def cross_entropy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A plain loss function returning the loss alone: cross-entropy of ``(image, class)`` batches."""
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def three_arguments(model: nn.Module, batch: torch.Tensor, scale: float) -> torch.Tensor:
    """Neither a loss function nor a factory: refused by ``--task``."""
    return model(batch).sum() * scale


def loss_of_shape(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A loss function that forgets the mean: refused when it is called."""
    return (model(batch[0]).reshape(batch[1].shape) - batch[1]) ** 2
