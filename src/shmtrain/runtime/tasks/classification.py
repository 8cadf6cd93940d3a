"""``--task classification`` (the default): cross-entropy against an integer class.

The loss of a batch is ``F.cross_entropy(model(x), y)`` (``nn.CrossEntropyLoss``'s mean,
with ``--task-args 'label_smoothing=0.1'`` its smoothing); the held-out metrics are the
mean cross-entropy and the accuracy (the share whose arg-max output is the label), the
primary metric, so runs of this task keep the ``accuracy`` of every output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional

from shmtrain.runtime.tasks.base import Task, TaskConfig, register


@register
class Classification(Task):
    """Integer class labels; loss cross-entropy, metric accuracy."""

    name = "classification"
    primary = "accuracy"
    higher_is_better = True
    metric_names = ("loss", "accuracy")
    takes_builtin_data = True

    @dataclass(kw_only=True, slots=True)
    class Config(TaskConfig):
        #: label smoothing of the training loss (the held-out loss is plain cross-entropy)
        label_smoothing: float = 0.0
        #: the dict key of the label in a dict batch
        target: str = "target"

        def __post_init__(self) -> None:
            if not 0.0 <= self.label_smoothing < 1.0:
                raise ValueError(f"--task-args label_smoothing={self.label_smoothing!r}: must be in [0, 1); "
                                 "use e.g. label_smoothing=0.1, or leave it out")

    config: Config

    def criterion(self) -> Callable[[Any, Any], torch.Tensor]:
        smoothing = self.config.label_smoothing
        if smoothing == 0.0:
            return torch.nn.CrossEntropyLoss()
        return torch.nn.CrossEntropyLoss(label_smoothing=smoothing)

    def loss(self, model: Callable[..., Any], batch: Any) -> torch.Tensor:
        output, target = self.forward(model, batch)
        return functional.cross_entropy(output, target, label_smoothing=self.config.label_smoothing)

    def sums(self, model: Callable[..., Any], batch: Any) -> dict[str, float]:
        output, target = self.forward(model, batch)
        return {"loss": float(functional.cross_entropy(output, target, reduction="sum")),
                "correct": int((output.argmax(1) == target).sum()), "n": len(target)}

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(1, int(sums.get("n", 0)))
        return {"loss": sums.get("loss", 0.0) / n, "accuracy": sums.get("correct", 0) / n}
