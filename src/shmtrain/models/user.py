"""``--model module:callable``: a model the user brings.

The spec names a callable in an importable module (the current directory is importable,
as for ``python -m``): a class or a function returning an :class:`torch.nn.Module`. It is
called with ``--model-args`` (``'k=v; k=v'``, Python literals, or a ``[model-args]`` TOML
table), plus ``input_shape`` (C, H, W of the data) and ``num_classes`` when its signature
takes them and they are not given. Everything a built-in model gets (checkpoints, resume,
plots, trace, compare) follows from the spec being in ``config.toml``.
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


def resolve_callable(spec: str, flag: str = "--model") -> Callable[..., Any]:
    """The callable ``module:name`` names; ValueError saying what is missing and the fix."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{flag} {spec!r}: write module:callable, e.g. {flag} mypkg.nets:Net")
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
    return target


def build_user_model(spec: str, args: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Call ``spec`` with ``--model-args`` (and ``input_shape`` / ``num_classes`` where it
    takes them); ValueError when it does not return an nn.Module."""
    factory = resolve_callable(spec)
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
