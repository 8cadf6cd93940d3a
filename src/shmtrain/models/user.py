"""``--model module:callable``: a model the user brings.

The spec names a callable in an importable module (the current directory is importable,
as for ``python -m``): a class or a function returning an :class:`torch.nn.Module`. It is
called with ``--model-args`` (``'k=v; k=v'``, Python literals, or a ``[model-args]`` TOML
table), plus ``input_shape`` (C, H, W of the data) and ``num_classes`` when its signature
takes them and they are not given. Everything a built-in model gets (checkpoints, resume,
plots, trace, compare) follows from the spec being in ``config.toml``.

A spec is a name of code that runs, so what it may name is checked before anything is
imported or called (:func:`resolve_callable`): nothing of Python's standard library or
its builtins (``os:system``, ``subprocess:run``, ``builtins:exec``; their modules are
refused by name, unimported, since importing some acts: ``antigravity`` opens a browser),
no function of torch itself (``torch.hub:load`` fetches and runs code; torch's classes,
e.g. ``torch.nn:Linear``, are accepted), and for ``--model`` a class must be an
:class:`torch.nn.Module`. This keeps a config from naming the obvious command runners;
it is not a sandbox: any function of an importable package can be named, and importing a
module runs it. The defence is that a config or run folder of another user is not read
at all (``shmtrain.runtime.trusted_files``).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

from torch import nn

from shmtrain.typed_options import parse_kwargs


def is_user_spec(name: str) -> bool:
    """Whether ``--model`` names ``module:callable`` rather than a registered model."""
    return ":" in name


def _standard(module_name: str) -> bool:
    """Whether ``module_name`` is of Python's standard library (or its builtins)."""
    top = module_name.partition(".")[0]
    return top in sys.stdlib_module_names or top in sys.builtin_module_names or top == "__main__"


def _refused(spec: str, flag: str, why: str) -> ValueError:
    return ValueError(f"{flag} {spec!r}: {why}, and shmtrain calls only the classes and functions of your own "
                      "modules or of installed packages (a config naming e.g. os:system would run a command); "
                      f"name one of yours, e.g. {flag} mypkg.nets:Net")


def _check_target(spec: str, target: Any, flag: str = "--model") -> None:
    """Refuse what a spec resolved to when it is of the standard library or builtins (a
    name a module took from there too), or a function of torch itself (module docstring)."""
    module = getattr(target, "__module__", None) or ""
    if _standard(module):
        raise _refused(spec, flag, f"it is {module}.{getattr(target, '__qualname__', '?')} of Python's standard "
                                   "library")
    if module.partition(".")[0] == "torch" and not isinstance(target, type):
        raise _refused(spec, flag, f"it is the function {module}.{getattr(target, '__qualname__', '?')} of torch "
                                   "itself, not a class")


def resolve_callable(spec: str, flag: str = "--model") -> Callable[..., Any]:
    """The callable ``module:name`` names; ValueError saying what is missing and the fix,
    or what it may not name (:func:`_check_target`; a standard library module is refused
    before it is imported)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{flag} {spec!r}: write module:callable, e.g. {flag} mypkg.nets:Net")
    if _standard(module_name):
        raise _refused(spec, flag, f"{module_name} is a module of Python's standard library")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # as python -m does: the current directory is importable
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{flag} {spec!r}: cannot import {module_name} ({exc}); run from the folder "
                         "that holds it, or add that folder to PYTHONPATH") from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{flag} {spec!r}: {module_name} has no {attr}; name a class or function "
                             "defined there")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{flag} {spec!r}: {attr} is a {type(target).__name__}, not a class or function")
    _check_target(spec, target, flag)
    return target


def build_user_model(spec: str, args: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Call ``spec`` with ``--model-args`` (and ``input_shape`` / ``num_classes`` where it
    takes them); ValueError when it does not return an nn.Module."""
    factory = resolve_callable(spec)
    if isinstance(factory, type) and not issubclass(factory, nn.Module):
        raise ValueError(f"--model {spec!r}: {factory.__module__}.{factory.__qualname__} is a class but not a "
                         "torch.nn.Module; name an nn.Module subclass, or a function that returns one")
    kwargs = parse_kwargs(args, "--model-args")
    try:
        accepted = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        accepted = {}
    for key, value in (("input_shape", tuple(input_shape)), ("num_classes", num_classes)):
        if key in accepted and key not in kwargs:
            kwargs[key] = value
    try:
        model = factory(**kwargs)
    except TypeError as exc:
        raise ValueError(f"--model {spec!r} with --model-args {args!r}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {spec!r} returned a {type(model).__name__}, not a torch.nn.Module")
    return model
