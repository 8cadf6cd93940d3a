"""argparse value types shared by the command lines (``bench``, ``sim``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable


def comma_list(what: str, choices: Iterable[str]) -> Callable[[str], list[str]]:
    """A type for ``--flag a,b,c``: the names, each one of ``choices``; ``what`` names one
    in the error (e.g. "allreduce", "algorithm")."""
    allowed = list(choices)

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(unknown) or repr(text)}; choose from {', '.join(allowed)}"
            )
        return names

    return parse
