"""Where local workers' stderr goes: ``RUN_DIR/logs/rank-<r>.log`` (with ``--verbose``
copied to the terminal as it comes), and what the launcher quotes from it."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path


class WorkerLogs:
    """Worker stderr goes to ``log_dir/rank-<r>.log`` (appended: restarts add to it); with
    ``verbose`` a thread copies what they write to the terminal as it comes. The
    terminal's stderr is passed on as ``SHMTRAIN_CONSOLE_FD`` for the progress line."""

    def __init__(self, log_dir: Path | None, nprocs: int, verbose: bool) -> None:
        # offsets: each log's size at the start of this launch (what it says is after them)
        self.dir, self.nprocs = log_dir, nprocs
        self.console = -1
        self.done = threading.Event()
        self.tail: threading.Thread | None = None
        if log_dir is None:
            return
        log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.console = os.dup(sys.stderr.fileno())
        except (AttributeError, OSError, ValueError):  # a captured stderr has no descriptor
            self.console = -1
        self.offsets = {}
        for rank in range(nprocs):
            path = log_dir / f"rank-{rank}.log"
            path.touch()
            self.offsets[rank] = path.stat().st_size
        if verbose:
            self.tail = threading.Thread(target=self._follow, name="shmtrain-logs", daemon=True)
            self.tail.start()

    def env(self) -> dict[str, str]:
        return {"SHMTRAIN_CONSOLE_FD": str(self.console)} if self.console >= 0 else {}

    def fds(self) -> tuple[int, ...]:
        return (self.console,) if self.console >= 0 else ()

    def path(self, rank: int) -> Path | None:
        return self.dir / f"rank-{rank}.log" if self.dir is not None else None

    def _follow(self) -> None:
        """--verbose: copy what each worker appends to its log to the terminal."""
        while True:
            finished = self.done.wait(0.1)
            for rank in range(self.nprocs):
                with open(self.path(rank), "rb") as f:  # type: ignore[arg-type]
                    f.seek(self.offsets[rank])
                    data = f.read()
                if data:
                    self.offsets[rank] += len(data)
                    sys.stderr.write(data.decode(errors="replace"))
                    sys.stderr.flush()
            if finished:
                return

    def where(self, rank: int) -> str:
        return f"; its log: {self.path(rank)}" if self.dir is not None else ""

    def last_line(self, rank: int) -> str:
        """The last line the worker wrote (what it said before a failure it could not report)."""
        lines = self.recent(rank, 20)
        last = next((line.strip() for line in reversed(lines) if line.strip()), "")
        return f" ({last})" if last else ""

    def recent(self, rank: int, count: int = 10) -> list[str]:
        """The last ``count`` lines the worker wrote in this launch (not a previous one's:
        the log is appended to)."""
        if self.dir is None:
            return []
        try:
            with open(self.path(rank), "rb") as f:  # type: ignore[arg-type]
                f.seek(max(self.offsets[rank], os.fstat(f.fileno()).st_size - 8192))
                return f.read().decode(errors="replace").splitlines()[-count:]
        except OSError:
            return []

    def close(self) -> None:
        self.done.set()
        if self.tail is not None:
            self.tail.join(timeout=2.0)
        if self.console >= 0:
            os.close(self.console)
            self.console = -1


def mark(log_dir: Path, nprocs: int, line: str) -> None:
    """Append ``line`` to every worker's log before a launch (what a later launch in the
    same folder, a ``--resume`` or a restart, adds is told apart by it)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    for rank in range(nprocs):
        with open(log_dir / f"rank-{rank}.log", "a", encoding="utf-8") as f:
            f.write(line.rstrip("\n") + "\n")
