"""``--task language-model``: next-token cross-entropy; its metric is the perplexity.

A batch is a tensor of token ids ``(B, T + 1)`` (the model reads ``[:, :-1]`` and is scored
on predicting ``[:, 1:]``), or an ``(inputs, targets)`` pair (or dict) of ``(B, T)`` ids the
data already shifted. The model returns ``(B, T, V)`` logits. The loss is the mean
cross-entropy per target token (``ignore_index`` tokens, -100 unless ``--task-args``,
left out); the held-out metrics are that mean over every held-out token (``loss``, nats
per token) and ``perplexity`` = exp(loss), the primary metric. The vocabulary size V
(given to a model as ``num_classes``) is the data set's ``vocab_size`` attribute, or the
largest token id + 1 of the items read (``runtime/tasks/data.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional

from shmtrain.runtime.tasks.base import Task, TaskConfig, register

#: training items read to find the vocabulary when the data set does not declare it
SCAN_LIMIT = 4096


def vocab_size(dataset: Any) -> int | None:
    """``vocab_size`` of ``dataset`` or of one it wraps (``.dataset``, as a Subset has)."""
    for _ in range(8):
        value = getattr(dataset, "vocab_size", None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        dataset = getattr(dataset, "dataset", None)
        if dataset is None:
            return None
    return None


@register
class LanguageModel(Task):
    """Token sequences; loss next-token cross-entropy, metric perplexity."""

    name = "language-model"
    primary = "perplexity"
    higher_is_better = False
    metric_names = ("loss", "perplexity")

    @dataclass(kw_only=True, slots=True)
    class Config(TaskConfig):
        #: target tokens with this id count in neither the loss nor the metrics (padding)
        ignore_index: int = -100
        #: the dict key of the targets in a dict batch
        target: str = "target"

        def __post_init__(self) -> None:
            if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
                raise ValueError(f"--task-args ignore_index={self.ignore_index!r}: must be an integer token id; "
                                 "use e.g. ignore_index=0, or leave it out (-100)")

    config: Config

    def logits_and_targets(self, model: Callable[..., Any], batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B*T, V)`` logits and ``(B*T,)`` target ids of ``batch``."""
        if isinstance(batch, torch.Tensor):
            if batch.dim() != 2 or batch.shape[1] < 2 or batch.is_floating_point():
                raise ValueError(f"--task language-model: a batch of token ids must be (batch, length + 1) "
                                 f"integers, not a {batch.dtype} tensor of shape {tuple(batch.shape)}; return "
                                 "a 1-d LongTensor of length + 1 ids per item")
            output, target = model(batch[:, :-1]), batch[:, 1:]
        else:
            output, target = self.forward(model, batch)
        if output.dim() < 2 or output.shape[:-1] != target.shape:
            raise ValueError(f"--task language-model: the model's output is {tuple(output.shape)} for targets "
                             f"{tuple(target.shape)}; return logits of shape (*targets, vocabulary)")
        return output.reshape(-1, output.shape[-1]), target.reshape(-1)

    def criterion(self) -> Callable[[Any, Any], torch.Tensor]:
        ignore = self.config.ignore_index

        def next_token(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1),
                                            ignore_index=ignore)
        return next_token

    def loss(self, model: Callable[..., Any], batch: Any) -> torch.Tensor:
        logits, target = self.logits_and_targets(model, batch)
        return functional.cross_entropy(logits, target, ignore_index=self.config.ignore_index)

    def sums(self, model: Callable[..., Any], batch: Any) -> dict[str, float]:
        logits, target = self.logits_and_targets(model, batch)
        ignore = self.config.ignore_index
        counted = int((target != ignore).sum())
        nll = float(functional.cross_entropy(logits.float(), target, ignore_index=ignore, reduction="sum"))
        return {"nll": nll, "tokens": counted}

    def output_size(self, train: Any) -> int:
        declared = vocab_size(train)
        if declared is not None:
            return declared
        if len(train) > SCAN_LIMIT:
            raise ValueError(f"--task language-model: the vocabulary size is not known: the data set has no "
                             f"vocab_size attribute and its {len(train)} items are more than the {SCAN_LIMIT} "
                             "read to find the largest token id; set dataset.vocab_size = V")
        largest = 0
        for i in range(len(train)):
            item = train[i]
            ids = (
                item[self.target_key]
                if isinstance(item, dict)
                else item[-1]
                if isinstance(item, tuple | list)
                else item
            )
            largest = max(largest, int(torch.as_tensor(ids).max()))
        return largest + 1

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        loss = sums.get("nll", 0.0) / max(1, int(sums.get("tokens", 0)))
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0))}
