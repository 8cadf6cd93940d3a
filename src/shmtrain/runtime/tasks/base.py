"""What a run learns: one :class:`Task` per kind, selected by name (``--task``) like a strategy.

A task turns ``(model, batch)`` into the loss the run descends and, on held-out batches,
into its metrics; the rest of the run (sharding, strategies, checkpoints and exact resume,
metrics rows, plots, trace, TensorBoard, ``compare``) does not depend on it. A batch is
whatever the data's items collate to, of any structure:

- a tensor: the model's one input; a task that needs a target makes it from the input
  (``language-model``: the next tokens);
- a tuple or list ``(input, ..., target)``: the model is called with every element but
  the last (several inputs), the last is the target;
- a dict: the model is called with every key but the target's as keyword arguments; the
  target is ``batch[target]`` (the task's ``target`` option, ``"target"`` unless
  ``--task-args 'target="y"'``).

Tasks are registered by :func:`register` (the built-ins ``classification``,
``regression``, ``language-model``); ``--task module:callable`` names the user's own (a
:class:`Task` subclass, a callable returning a :class:`Task`, or a plain loss function),
see :mod:`shmtrain.runtime.tasks.lookup`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from shmtrain.registry import Registry


@dataclass(kw_only=True, slots=True)
class TaskConfig:
    """Options shared by no task: each task subclasses this with its own fields."""


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it on ``device`` (tuples, lists and dicts kept)."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def batch_size(batch: Any) -> int:
    """The samples in ``batch``: the length of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, tuple | list) else []
    for value in values:
        size = batch_size(value)
        if size:
            return size
    return 0


def split_batch(batch: Any, parts: int) -> list[Any]:
    """``batch`` cut into ``parts`` batches along the first dimension of every tensor
    (sizes differ by at most 1, as ``Tensor.tensor_split``)."""
    if isinstance(batch, torch.Tensor):
        return list(batch.tensor_split(parts))
    if isinstance(batch, Mapping):
        cut = {key: split_batch(value, parts) for key, value in batch.items()}
        return [{key: pieces[i] for key, pieces in cut.items()} for i in range(parts)]
    if isinstance(batch, tuple | list):
        cut_items = [split_batch(value, parts) for value in batch]
        return [type(batch)(pieces[i] for pieces in cut_items) for i in range(parts)]
    return [batch] * parts


class Task:
    """Base class: a task's loss and held-out metrics over batches of any structure.

    A subclass sets :attr:`name`, its :attr:`Config`, its :attr:`primary` metric and
    :attr:`higher_is_better`, and implements :meth:`loss`, :meth:`sums` and
    :meth:`metrics`; :meth:`evaluate` and the batch conventions (module docstring) are
    shared.
    """

    name: ClassVar[str] = ""
    Config: ClassVar[type[TaskConfig]] = TaskConfig
    #: the metric a run reports first (``summary.json``'s ``metric``) and selects by
    primary: ClassVar[str] = "loss"
    #: whether a larger value of :attr:`primary` is better
    higher_is_better: ClassVar[bool] = False
    #: every metric :meth:`metrics` returns (``--keep-best``, ``--early-stop`` name one)
    metric_names: ClassVar[tuple[str, ...]] = ("loss",)
    #: the run's data may be a built-in kind (digits, synthetic, a folder of images),
    #: whose items are (image, class); otherwise ``--data module:callable`` only
    takes_builtin_data: ClassVar[bool] = False
    #: the dict key of the target in a dict batch (tasks with a ``target`` option read it)
    target_key: str = "target"

    def __init__(self, config: TaskConfig | None = None) -> None:
        self.config = config if config is not None else self.Config()
        self.target_key = getattr(self.config, "target", "target")

    # -- the batch conventions --------------------------------------------------------
    def forward(self, model: Callable[..., Any], batch: Any) -> tuple[Any, Any]:
        """``(output, target)`` of ``batch`` (module docstring); target None for a bare tensor."""
        if isinstance(batch, torch.Tensor):
            return model(batch), None
        if isinstance(batch, Mapping):
            if self.target_key not in batch:
                raise ValueError(
                    f"--task {self.name}: a dict batch without the target key {self.target_key!r} (its keys: "
                    f"{', '.join(map(str, batch))}); name the target's key with --task-args "
                    "'target=\"KEY\"'")
            inputs = {key: value for key, value in batch.items() if key != self.target_key}
            return model(**inputs), batch[self.target_key]
        if isinstance(batch, tuple | list) and len(batch) >= 2:
            return model(*batch[:-1]), batch[-1]
        raise ValueError(f"--task {self.name}: a batch of {type(batch).__name__} is neither a tensor, "
                         "an (input, ..., target) tuple nor a dict; return one of those from the data's items")

    # -- what a subclass gives ------------------------------------------------------
    def loss(self, model: Callable[..., Any], batch: Any) -> torch.Tensor:
        """The batch's mean loss, differentiable (what the run descends)."""
        raise NotImplementedError

    def sums(self, model: Callable[..., Any], batch: Any) -> dict[str, float]:
        """Additive totals of one held-out batch (e.g. summed loss and count)."""
        raise NotImplementedError

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """The held-out metrics from the totals of every batch: ``loss`` first, then the
        task's own (:attr:`primary` among them)."""
        raise NotImplementedError

    def criterion(self) -> Callable[[Any, Any], torch.Tensor] | None:
        """``loss(output, target)`` for ``(input, target)`` batches, for the sub-batch
        threads (``--sub-batch``); None where the task has none."""
        return None

    def output_size(self, train: Any) -> int:
        """The model's output size for the training items ``train`` (a model that takes
        ``num_classes`` is given it): a task that does not take the built-in kinds says."""
        raise ValueError(f"--task {self.name}: it cannot tell the model's output size from the data; give "
                         "the size in --model-args")

    # -- shared ---------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[Any]) -> dict[str, float]:
        """:meth:`metrics` of ``model`` over ``batches``, in ``eval()`` mode (the model's
        mode is restored), each batch moved to the model's device."""
        was_training = model.training
        model.eval()
        totals: dict[str, float] = {}
        try:
            device = next(model.parameters()).device
            for batch in batches:
                for key, value in self.sums(model, to_device(batch, device)).items():
                    totals[key] = totals.get(key, 0.0) + value
        finally:
            model.train(was_training)
        return self.metrics(totals)

    def better(self, metric: str, value: float | None, best: float | None) -> bool:
        """Whether ``value`` of ``metric`` improves on ``best`` (None: nothing yet); larger is
        better for :attr:`primary` when :attr:`higher_is_better`, smaller for the others."""
        if value is None or math.isnan(value):
            return False
        if best is None:
            return True
        return value > best if metric == self.primary and self.higher_is_better else value < best


#: every built-in task by name (importing :mod:`shmtrain.runtime.tasks` fills it)
TASKS: Registry[type[Task]] = Registry(
    "task", "--task", hint=", or module:callable for your own (a Task subclass, or a loss function)")


def register(cls: type[Task]) -> type[Task]:
    """Class decorator: make a task selectable by its ``name``."""
    return TASKS.register(cls)


def registry() -> dict[str, type[Task]]:
    """Every registered task by name (importing :mod:`shmtrain.runtime.tasks` fills it)."""
    return TASKS.items()
