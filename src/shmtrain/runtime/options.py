"""How :class:`shmtrain.runtime.config.TrainConfig`'s fields are declared: the sections
of ``shmtrain train --help``, :func:`option` (a field with its help and section) and
:func:`need` (one check, one message naming the flag, the value, the rule and the fix)."""

from __future__ import annotations

from dataclasses import field
from typing import Any

#: section key (``metadata["section"]``) -> title of its argument group in ``--help``
SECTIONS: dict[str, str] = {"job": "job", "data": "model and data", "optim": "optimisation",
                            "monitor": "evaluation and monitoring"}


def option(default: Any, help: str, section: str, **extra: Any) -> Any:
    """A :class:`TrainConfig` field: its default, its ``--help`` text and its section.

    ``extra`` goes into the metadata too: ``flag`` (a flag name other than ``--<name>``),
    ``action`` (an argparse action for it, e.g. ``store_false``), ``default_text`` (what
    ``--help`` shows as the default), ``names`` (a callable listing the valid names, shown
    in ``--help``), ``metavar``, and ``example`` (a valid value for error messages when
    the default is None).
    """
    if section not in SECTIONS:
        raise ValueError(f"section {section!r} is unknown; choose one of {', '.join(SECTIONS)}")
    return field(default=default, metadata={"help": help, "section": section, **extra})


def need(ok: bool, flag: str, value: Any, rule: str, fix: str) -> None:
    """ValueError ``--FLAG VALUE: RULE; FIX`` unless ``ok``."""
    if not ok:
        raise ValueError(f"--{flag} {value!r}: {rule}; {fix}")
