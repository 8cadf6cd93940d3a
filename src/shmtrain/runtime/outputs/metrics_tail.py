"""The end of a rank's metrics file, read from the end: what a worker replaced in place
needs of it (the last iteration logged, and the file cut back to a step) without parsing
every row the run has written, so a recovery costs the same at iteration 100 and 100,000.

A metrics file is whole JSON lines, one per iteration in order, with ``{"eval": ...}``
rows between them (:class:`~shmtrain.runtime.files.LineLog`); only its end can hold a
line a kill cut short, or rows past the step a rank goes on from.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: bytes read from the end at a time
BLOCK = 64 << 10


def _lines_from_end(path: Path) -> Iterator[tuple[int, bytes, bool]]:
    """(offset, line, whole) from the last line back to the first; ``whole``: ended by a
    newline (a last line without one is what a kill left)."""
    with open(path, "rb") as f:
        pos = f.seek(0, os.SEEK_END)
        head = b""  # the bytes from ``pos`` to the first newline after it: a line's end, not yet whole
        last = True  # the text after the file's last newline is still to come
        while pos > 0:
            step = min(BLOCK, pos)
            pos -= step
            f.seek(pos)
            data = f.read(step) + head
            parts = data.split(b"\n")
            cursor = pos + len(data)
            for part in reversed(parts[1:]):
                start = cursor - len(part)
                if not last:
                    yield start, part, True
                elif part:
                    yield start, part, False
                last = False
                cursor = start - 1  # the newline before it
            head = parts[0]
        if head:
            yield 0, head, not last


def _iteration(line: bytes) -> tuple[int, bool] | None:
    """(iteration, is an evaluation row) of a line, None for one that is not a row."""
    try:
        row: Any = json.loads(line)
        if "eval" in row:
            return int(row["eval"]["iteration"]), True
        return int(row["iteration"]), False
    except (ValueError, KeyError, TypeError):
        return None


def last_iteration(path: Path) -> int:
    """The last training iteration ``path`` logged (0: none, or no file)."""
    if not path.exists():
        return 0
    for _, line, whole in _lines_from_end(path):
        found = _iteration(line) if whole else None
        if found is not None and not found[1]:
            return found[0]
    return 0


def cut_after(path: Path, upto: int) -> None:
    """Cut ``path`` back to its rows of iterations up to ``upto``: a last line a kill cut
    short, and rows past ``upto`` (an evaluation row counts at its iteration), are removed
    from the end; the rows before stay as they are."""
    if not path.exists():
        return
    keep = None
    for offset, line, whole in _lines_from_end(path):
        found = _iteration(line) if whole else None
        if found is not None and found[0] <= upto:
            keep = offset + len(line) + 1
            break
    os.truncate(path, keep or 0)
