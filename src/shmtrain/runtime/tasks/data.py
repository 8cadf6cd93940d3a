"""The data of a task that does not take the built-in kinds: ``--data module:callable``
read with the task's rules (``regression``, ``language-model``, the user's own tasks).

The callable and its ``(train, val)`` split are those of every user data set
(:mod:`shmtrain.runtime.data.user_data`: ``--data-args``, ``--val-fraction``); the items
may be of any structure the task reads (``runtime/tasks/base.py``). What the run needs is
read from training item 0: the input shape (its first tensor's), and the model's output
size from the task (:meth:`~shmtrain.runtime.tasks.base.Task.output_size`), given to a
model that takes ``num_classes``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import default_collate

from shmtrain.models.user import is_user_spec
from shmtrain.runtime.data import user_data
from shmtrain.runtime.data.sources import FACTS_MARK, DataSource, open_data
from shmtrain.runtime.files import write_atomic
from shmtrain.runtime.tasks.base import Task
from shmtrain.runtime.tasks.lookup import task_of


def first_tensor(item: Any) -> torch.Tensor | None:
    """The first tensor in ``item`` (a tensor, tuple, list or dict), None when it has none."""
    if isinstance(item, torch.Tensor):
        return item
    values = item.values() if isinstance(item, Mapping) else item if isinstance(item, tuple | list) else ()
    for value in values:
        found = first_tensor(value)
        if found is not None:
            return found
    return None


def open_run_data(config: Any, task: Task) -> DataSource:
    """The run's :class:`DataSource` for ``task``: the built-in kinds and (input, class)
    items for a task that takes them (classification: ``runtime/data/sources.py``), else
    ``--data module:callable`` read with the task's rules (:func:`open_task_data`)."""
    if task.takes_builtin_data:
        return open_data(config)
    return open_task_data(config, task)


def open_task_data(config: Any, task: Task) -> DataSource:
    """The :class:`DataSource` of ``--data module:callable`` for ``task``."""
    spec = config.data
    if not is_user_spec(spec):
        raise ValueError(f"--task {task.name} with --data {spec}: the built-in data kinds (digits, synthetic, "
                         "a folder of images) hold (image, class) items for --task classification; give "
                         "--data module:callable returning your Dataset (docs/tasks.md)")
    train, val = user_data.split_user_data(spec, user_data.call_data(spec, config.data_args), config.val_fraction)
    first = first_tensor(train[0])
    if first is None:
        raise ValueError(f"--data {spec!r}: training item 0 holds no tensor ({type(train[0]).__name__}); return "
                         "tensors, or tuples/dicts of tensors, from __getitem__")
    return DataSource(spec, train, val, task.output_size(train), tuple(first.shape), {})


def task_facts(config: Any, facts_type: Callable[..., Any]) -> Any:
    """The launcher's data facts (``facts_type``: preflight's ``DataFacts``) for a task that
    reads its own items, with a probe that runs a model on two of them (the memory
    estimate's forward pass); None for a task of the built-in kinds (classification)."""
    task = task_of(config)
    if task.takes_builtin_data:
        return None
    source = open_task_data(config, task)
    sample = default_collate([source.train[i] for i in range(min(2, source.train_samples))])
    return facts_type(source.train_samples, source.input_shape, source.num_classes, in_memory=False,
                      probe=functools.partial(task.forward, batch=sample))


def write_task_facts(out: Path, source: DataSource, task: Task) -> None:
    """The data's facts at the end of ``config.toml`` (rank 0; facts already there are
    replaced), and an empty ``classes.json`` (no classes)."""
    write_atomic(out / "classes.json", (json.dumps(source.classes) + "\n").encode())
    toml = out / "config.toml"
    if toml.is_file():
        text = toml.read_text(encoding="utf-8")
        text = text.split(FACTS_MARK)[0] if FACTS_MARK in text else text
        shape = "x".join(str(d) for d in source.input_shape)
        facts = (f"{FACTS_MARK} inputs {shape} (item 0's first tensor), model output size "
                 f"{source.num_classes} (--task {task.name}),\n"
                 f"# {source.train_samples} training samples, {source.val_samples} held out\n")
        write_atomic(toml, (text + facts).encode())
