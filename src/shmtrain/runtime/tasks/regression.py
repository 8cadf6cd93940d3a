"""``--task regression``: mean squared error against a real-valued target.

The loss of a batch is ``F.mse_loss(output, target)``, the mean over every element; a
target with the output's number of elements but another shape (``(B,)`` against
``(B, 1)``) is read in the output's shape, any other mismatch is refused with both shapes
(broadcasting would silently train on the wrong loss). The held-out metrics are the mean
squared error (``loss``) and its square root, ``rmse``, the primary metric. The model's
output size (``num_classes`` of a model that takes it) is the target's size per item.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional

from shmtrain.runtime.tasks.base import Task, TaskConfig, register


def matched(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``target`` in ``output``'s shape and dtype; ValueError when the sizes differ."""
    if target.shape != output.shape:
        if target.numel() != output.numel():
            raise ValueError(f"--task regression: the model's output is {tuple(output.shape)} but the target "
                             f"is {tuple(target.shape)}; give the model one output per target value (its "
                             "num_classes is the target's size per item)")
        target = target.reshape(output.shape)
    return target.to(output.dtype)


def squared_error(output: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """``F.mse_loss`` of ``output`` against ``target`` in its shape (:func:`matched`)."""
    return functional.mse_loss(output, matched(output, target), reduction=reduction)


@register
class Regression(Task):
    """Real-valued targets; loss mean squared error, metric RMSE."""

    name = "regression"
    primary = "rmse"
    higher_is_better = False
    metric_names = ("loss", "rmse")

    @dataclass(kw_only=True, slots=True)
    class Config(TaskConfig):
        #: the dict key of the target in a dict batch
        target: str = "target"

        def __post_init__(self) -> None:
            if not self.target or not isinstance(self.target, str):
                raise ValueError(f"--task-args target={self.target!r}: must be a non-empty key name; "
                                 "use e.g. target=\"y\"")

    def criterion(self) -> Callable[[Any, Any], torch.Tensor]:
        return squared_error

    def loss(self, model: Callable[..., Any], batch: Any) -> torch.Tensor:
        output, target = self.forward(model, batch)
        if target is None:
            raise ValueError("--task regression: a batch of one tensor has no target; return (input, target) "
                             "pairs or dicts with a target key from the data's items")
        return squared_error(output, target)

    def sums(self, model: Callable[..., Any], batch: Any) -> dict[str, float]:
        output, target = self.forward(model, batch)
        if target is None:
            raise ValueError("--task regression: a held-out batch of one tensor has no target; return "
                             "(input, target) pairs")
        return {"squared": float(squared_error(output.float(), target, "sum")), "values": output.numel()}

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        mse = sums.get("squared", 0.0) / max(1, int(sums.get("values", 0)))
        return {"loss": mse, "rmse": math.sqrt(mse)}

    def output_size(self, train: Any) -> int:
        item = train[0]
        if isinstance(item, dict) and self.target_key in item:
            target = item[self.target_key]
        elif isinstance(item, tuple | list) and len(item) >= 2:
            target = item[-1]
        else:
            raise ValueError(f"--task regression: training item 0 is a {type(item).__name__}, not an (input, "
                             f"target) pair or a dict with key {self.target_key!r}; return (x, y) from "
                             "__getitem__")
        return int(torch.as_tensor(target).numel())
