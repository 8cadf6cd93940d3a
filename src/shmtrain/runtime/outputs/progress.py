"""The progress line of ``shmtrain train``: rank 0 rewrites one line on the launcher's
terminal (iteration, loss, iterations per second)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any


def console() -> Any:
    """Where the progress line goes: the launcher's terminal (``SHMTRAIN_CONSOLE_FD``,
    since this worker's own stderr goes to its log file), else stderr."""
    fd = os.environ.get("SHMTRAIN_CONSOLE_FD")
    if fd:
        try:
            return open(int(fd), "w", closefd=False)  # noqa: SIM115 - the launcher owns the descriptor
        except (OSError, ValueError):
            pass
    return sys.stderr


class Progress:
    """One self-rewriting line on the terminal: iteration, loss, iterations per second."""

    def __init__(self, total: int, label: str, enabled: bool, first: int = 0) -> None:
        self.total, self.label = total, label
        self.enabled = enabled and os.environ.get("SHMTRAIN_NO_PROGRESS") != "1"
        self.stream = console() if self.enabled else sys.stderr
        self.tty = self.stream.isatty()
        self.start = time.perf_counter()
        self.first = first  # a resumed run's starting iteration (for the rate)
        self.last = 0.0

    def update(self, iteration: int, loss: float) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.last < (0.2 if self.tty else 5.0) and iteration < self.total:
            return
        self.last = now
        rate = (iteration - self.first) / max(now - self.start, 1e-9)
        width = 24
        done = min(width, int(width * iteration / max(self.total, 1)))
        line = (f"[{self.label}] [{'#' * done}{'.' * (width - done)}] {iteration}/{self.total} "
                f"loss {loss:.4f}  {rate:.1f} it/s")
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=self.stream, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=self.stream)


#: seconds an evaluation runs before it reports its progress (then again every as many)
EVAL_REPORT_S = 5.0


def _items(batch: Any) -> int:
    """Items in one held-out batch (``(x, y)``, a dict of tensors, or a tensor)."""
    first = batch[0] if isinstance(batch, (tuple, list)) and batch else \
        next(iter(batch.values()), None) if isinstance(batch, dict) else batch
    return len(first) if hasattr(first, "__len__") else 1


def evaluation_progress(batches: Any, total: int, iteration: int, stream: Any = None,
                        every: float = EVAL_REPORT_S) -> Any:
    """``batches`` of a held-out evaluation, passed through; once it has run ``every``
    seconds, a line every ``every`` seconds on ``stream`` (the launcher's terminal): the
    items done of ``total`` and their rate, so a long evaluation is not mistaken for a hang."""
    start = time.perf_counter()
    last, done = start, 0
    out = stream if stream is not None else console()
    for batch in batches:
        yield batch
        done += _items(batch)
        now = time.perf_counter()
        if now - last >= every:
            last = now
            print(f"evaluating the model of iteration {iteration}: {done}/{total} held-out items "
                  f"({done / max(now - start, 1e-9):.0f} items/s)", file=out, flush=True)
