"""``--task module:loss``: a task given as a plain loss function ``loss(model, batch)``.

The shape users know from Lightning's ``training_step`` and from plain PyTorch loops: the
function calls the model on the batch itself and returns the batch's mean loss, a 0-d
tensor, or ``(loss, metrics)`` with ``metrics`` a dict of numbers (or 0-d tensors). The
run descends the loss; a held-out evaluation reports the loss and each returned metric
averaged over the held-out samples (every batch weighted by its size), ``loss`` the
primary metric (smaller is better).

Which kind of callable ``--task module:callable`` names is told from its signature
(:func:`shmtrain.runtime.tasks.lookup.kind_of`): a function of exactly two required
positional parameters is a loss function.

Its data: the built-in kinds (digits, synthetic, a folder of images) give ``(image,
class)`` batches and the model their number of classes, as ``classification`` does;
``--data module:callable`` gives items of any structure, and the model's output size
(a model's ``num_classes``) is the data set's ``num_classes`` attribute, else the
target's size per item (the last element of a tuple item, ``item["target"]`` of a dict).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from shmtrain.runtime.tasks.base import Task, batch_size


def _number(spec: str, name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach())
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"--task {spec!r}: its metric {name!r} is a {type(value).__name__}; return numbers or 0-d "
                     "tensors in the metrics dict of (loss, metrics)")


class LossFunction(Task):
    """A task from ``loss(model, batch)``: the loss descended, the loss and the returned
    metrics held out (module docstring)."""

    primary = "loss"
    higher_is_better = False
    metric_names = ("loss",)

    def __init__(self, spec: str, function: Callable[..., Any], builtin_data: bool = False) -> None:
        super().__init__()
        self.name = spec  # an instance's name: the spec it was given by
        self.function = function
        #: the run's data is a built-in kind (``(image, class)`` items), read as classification reads it
        self.takes_builtin_data = builtin_data

    def _call(self, model: Callable[..., Any], batch: Any) -> tuple[torch.Tensor, Mapping[str, Any]]:
        result = self.function(model, batch)
        metrics: Any = {}
        if isinstance(result, tuple | list) and len(result) == 2:
            result, metrics = result
            if not isinstance(metrics, Mapping):
                raise ValueError(f"--task {self.name!r}: it returned (loss, {type(metrics).__name__}); the second "
                                 "element must be a dict of metric name -> number")
        if not isinstance(result, torch.Tensor):
            raise ValueError(f"--task {self.name!r}: it returned a {type(result).__name__}; return the batch's "
                             "mean loss as a 0-d tensor, or (loss, metrics)")
        if result.dim() != 0:
            raise ValueError(f"--task {self.name!r}: it returned a loss of shape {tuple(result.shape)}; return "
                             "the batch's mean, a 0-d tensor (e.g. loss.mean())")
        return result, metrics

    def loss(self, model: Callable[..., Any], batch: Any) -> torch.Tensor:
        return self._call(model, batch)[0]

    def sums(self, model: Callable[..., Any], batch: Any) -> dict[str, float]:
        loss, metrics = self._call(model, batch)
        n = batch_size(batch) or 1
        sums = {"n": float(n), "loss": float(loss.detach()) * n}
        for key, value in metrics.items():
            if key in ("n", "loss"):
                raise ValueError(f"--task {self.name!r}: its metrics dict has the key {key!r}, which the run "
                                 "keeps for its own; name the metric otherwise")
            sums[str(key)] = _number(self.name, str(key), value) * n
        return sums

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(1.0, sums.get("n", 0.0))
        out = {"loss": sums.get("loss", 0.0) / n}
        out.update({key: value / n for key, value in sums.items() if key not in ("n", "loss")})
        return out

    def output_size(self, train: Any) -> int:
        declared = getattr(train, "num_classes", None) or getattr(getattr(train, "dataset", None), "num_classes",
                                                                  None)
        if isinstance(declared, int) and declared > 0:
            return declared
        item = train[0]
        if isinstance(item, Mapping) and self.target_key in item:
            return int(torch.as_tensor(item[self.target_key]).numel())
        if isinstance(item, tuple | list) and len(item) >= 2:
            return int(torch.as_tensor(item[-1]).numel())
        raise ValueError(f"--task {self.name!r}: the model's output size is not known (training item 0 is a "
                         f"{type(item).__name__} with no target, and the data set has no num_classes attribute); "
                         "give it in --model-args, or set dataset.num_classes")
