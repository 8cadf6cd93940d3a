"""What ``--task`` names, built into a :class:`~shmtrain.runtime.tasks.base.Task`.

``--task NAME`` is a registered task (``runtime/tasks/base.py``'s registry); ``--task
module:callable`` is the user's own, told apart by :func:`kind_of` from what the callable
is and its signature:

- a :class:`Task` subclass: built with its ``Config`` filled from ``--task-args``;
- a function of no required parameters (a factory): called with ``--task-args`` as
  keyword arguments, and must return a :class:`Task`;
- a function of exactly two required positional parameters: a loss function
  ``loss(model, batch) -> loss`` or ``-> (loss, metrics)``
  (:class:`~shmtrain.runtime.tasks.loss_function.LossFunction`), which takes no
  ``--task-args``;
- anything else is refused in one line saying what is expected.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, Literal

from shmtrain.models.user import is_user_spec, resolve_callable
from shmtrain.runtime.tasks.base import TASKS, Task, TaskConfig
from shmtrain.runtime.tasks.loss_function import LossFunction
from shmtrain.typed_options import parse_kwargs

Kind = Literal["task", "factory", "loss"]

#: what ``--task module:callable`` may name, for the refusals' sentence
EXPECTED = ("a loss function loss(model, batch) -> loss or (loss, metrics), a shmtrain Task subclass, or a "
            "function of no required arguments returning a Task (docs/tasks.md)")


def kind_of(spec: str, target: Callable[..., Any]) -> Kind:
    """``"task"`` (a Task subclass), ``"loss"`` (two required positional parameters) or
    ``"factory"`` (no required parameter, or no signature to read: its result is checked)
    of what ``--task spec`` resolved to; ValueError in one line for anything else."""
    if isinstance(target, type):
        if issubclass(target, Task):
            return "task"
        raise ValueError(f"--task {spec!r}: {target.__module__}.{target.__qualname__} is a class but not a "
                         f"shmtrain Task; name {EXPECTED}")
    try:
        parameters = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin): called as a factory
        return "factory"
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    required = [p for p in parameters if p.default is inspect.Parameter.empty and p.kind not in variadic]
    if not required:
        return "factory"
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if len(required) == 2 and all(p.kind in positional for p in required):
        return "loss"
    names = ", ".join(p.name for p in required)
    raise ValueError(f"--task {spec!r}: it takes {len(required)} required argument(s) ({names}); name {EXPECTED}")


def task_class(name: str) -> type[Task] | Callable[..., Any]:
    """The class ``--task NAME`` names, or the callable of ``--task module:callable``
    (checked by :func:`kind_of`)."""
    if is_user_spec(name):
        target = resolve_callable(name, "--task")
        kind_of(name, target)
        return target
    return TASKS.get(name)


def build_config(name: str, args: str) -> TaskConfig:
    """The typed Config of ``--task name`` from ``--task-args`` (``'k=v; k=v'``); an
    option the task does not take is refused, naming what it takes."""
    kwargs = parse_kwargs(args, "--task-args")
    cls = task_class(name)
    if is_user_spec(name) and kind_of(name, cls) == "loss":
        if kwargs:
            raise ValueError(f"--task-args {args!r}: --task {name} is a loss function (model, batch), which takes "
                             "no options; leave --task-args out")
        return TaskConfig()
    config_cls = cls.Config if isinstance(cls, type) and issubclass(cls, Task) else None
    if config_cls is None:  # a factory: its own keyword arguments, checked when it is called
        if kwargs:
            _check_call(name, cls, kwargs)
        return TaskConfig()
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        takes = ", ".join(sorted(known)) or "no options"
        raise ValueError(f"--task-args {args!r}: {', '.join(unknown)} does not apply to --task {name} "
                         f"(it takes {takes}); leave it out")
    try:
        return config_cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"--task-args {args!r}: {exc}; give the options --task {name} takes") from None


def _check_call(name: str, factory: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise ValueError(f"--task {name!r} with --task-args: {exc}; give the arguments it takes") from None
    except ValueError:  # no signature to check
        pass


def build_task(name: str, args: str = "", config: TaskConfig | None = None, data: str | None = None) -> Task:
    """The :class:`Task` ``--task name --task-args args`` names (``config``: its typed
    Config, already built; ``data``: the run's ``--data``, which tells a loss function's
    task whether its batches are the built-in kinds' ``(image, class)``)."""
    cls = task_class(name)
    if isinstance(cls, type) and issubclass(cls, Task):
        return cls(config if config is not None else build_config(name, args))
    if is_user_spec(name) and kind_of(name, cls) == "loss":
        build_config(name, args)  # refuses --task-args
        return LossFunction(name, cls, builtin_data=data is not None and not is_user_spec(data))
    task = cls(**parse_kwargs(args, "--task-args"))
    if not isinstance(task, Task):
        raise ValueError(f"--task {name!r} returned a {type(task).__name__}, not a shmtrain Task; return an "
                         "instance of a shmtrain.runtime.tasks.Task subclass, or name a loss function "
                         "loss(model, batch) (docs/tasks.md)")
    return task


def task_of(config: Any) -> Task:
    """The task of a resolved ``TrainConfig`` (``classification`` for a config without one)."""
    name = getattr(config, "task", "classification")
    return build_task(name, getattr(config, "task_args", ""), getattr(config, "task_config", None),
                      getattr(config, "data", None))
