"""Typed options: what an annotation allows, for flags, TOML keys and Python alike.

Layer 0 (imports nothing of shmtrain): ``runtime/config.py`` builds ``shmtrain train``'s
flags and checks TOML values and Python arguments with these, from the annotations of
its dataclasses and of every strategy's ``Config`` (bool, int, float, str, Optional and
Literal are known; anything else is taken as it is).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import math
import types
import typing
from typing import Any, Literal


def hint_kind(hint: Any) -> tuple[type, tuple[Any, ...] | None]:
    """The scalar type (bool, int, float or str) and the choices (a Literal's values, or
    None) of an annotation; ``X | None`` is ``X``. Anything else is ``(str, None)``."""
    hint = strip_none(hint)
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        return type(choices[0]), choices
    for kind in (bool, int, float, str):
        if hint is kind:
            return kind, None
    for arg in typing.get_args(hint):
        if arg in (bool, int, float, str):
            return arg, None
    return str, None


def type_rule(hint: Any, value: Any) -> str | None:
    """The rule ``value`` breaks for annotation ``hint`` (e.g. "must be an integer"), or
    None when it fits. Knows bool, int (for a float field too), float (finite: inf and
    nan are refused), str, Optional and Literal; anything else fits."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        rules = [type_rule(arg, value) for arg in args if arg is not type(None)]
        return None if None in rules else rules[0]
    if typing.get_origin(hint) is Literal:
        if any(value == choice and type(value) is type(choice) for choice in args):
            return None
        return "must be one of: " + ", ".join(str(choice) for choice in args)
    if hint is bool:
        return None if isinstance(value, bool) else "must be true or false"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "must be an integer"
    if hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if ok and not math.isfinite(value):
            return "must be a finite number (not inf or nan)"
        return None if ok else "must be a number"
    if hint is str:
        return None if isinstance(value, str) else "must be a string"
    return None


def strip_none(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def coerce(hint: Any, value: Any) -> Any:
    """An int given for a float field becomes a float (``lr = 1`` is ``1.0``)."""
    if strip_none(hint) is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def example(f: dataclasses.Field, hint: Any) -> Any:
    """A valid value of field ``f`` for an error message: its default, or a typical one."""
    if "example" in f.metadata:
        return f.metadata["example"]
    if f.default is not dataclasses.MISSING and f.default is not None:
        return f.default
    kind, choices = hint_kind(hint)
    if choices:
        return choices[0]
    return {bool: True, int: 1, float: 1.0}.get(kind, "...")


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def parse_kwargs(text: str, flag: str) -> dict[str, Any]:
    """``'k=v; k=v'`` -> keyword arguments (values are Python literals), for ``flag``."""
    args: dict[str, Any] = {}
    for item in (part.strip() for part in text.split(";")):
        if not item:
            continue
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ValueError(f"{flag} {text!r}: {item!r} is not k=v; write e.g. {flag} 'width=64; depth=3'")
        try:
            args[key] = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"{flag} {text!r}: the value of {key} ({raw.strip()!r}) is not a Python "
                             "literal; write numbers, tuples, True/False or quoted strings") from None
    return args
