"""The stretches of a run: each launch of ``shmtrain train`` on one run folder (the first,
every ``--resume``, every restart after a worker's death) is a stretch.

``RUN_DIR/stretches.json`` lists them, one object each: ``stretch`` (1, 2, ...),
``started_at`` (local time, ISO 8601), ``start_iteration`` (the checkpoint it started
from; 0 for the first), ``end_iteration`` (the last iteration it logged), ``wall_s`` and
``ended`` (``finished``, ``interrupted`` or ``failed``). ``summary.json`` carries the list
and ``wall_s``, their sum: the whole run's time, not the last stretch's. Each stretch
first appends a header line (``--- stretch K: started ..., from iteration N ---``) to
every ``logs/rank-<r>.log``, which later stretches append to, so each stretch's log is
kept and told apart.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from shmtrain.runtime.files import OutputError, write_output
from shmtrain.runtime.outputs.worker_logs import mark

FILE = "stretches.json"
ENDINGS = ("finished", "interrupted", "failed")
#: a stretch whose launch has not ended it (yet, or ever: it was killed)
RUNNING = "running"


def read(out: Path) -> list[dict[str, Any]]:
    """The stretches recorded in ``out`` (none when the file is missing or unreadable)."""
    try:
        entries = json.loads((out / FILE).read_text())
    except (OSError, ValueError):
        return []
    return entries if isinstance(entries, list) else []


class Stretch:
    """One launch on the run folder ``out``, from ``start_iteration``; with ``workers``
    (a local launch) its header goes into every worker's log first."""

    def __init__(self, out: Path, start_iteration: int, workers: int | None = None) -> None:
        self.out = out
        entries = close_running(read(out), out)
        self.number = len(entries) + 1
        self.started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.start_iteration = start_iteration
        self.t0 = time.perf_counter()
        self.epoch0 = time.time()
        # recorded at once, ``running``: a launch killed before it could end its stretch (rank 0
        # under torchrun, the launcher by SIGKILL) is still listed, and the next one closes it
        entries.append({"stretch": self.number, "started_at": self.started_at, "start_iteration": start_iteration,
                        "end_iteration": start_iteration, "wall_s": 0.0, "ended": RUNNING,
                        "started_epoch": self.epoch0})
        if out.is_dir():
            try:
                write_output(out / FILE, (json.dumps(entries, indent=2) + "\n").encode())
            except OutputError:  # a full disk: the run's own writes say so; its end is recorded then
                pass
        if workers is not None:
            mark(out / "logs", workers, f"--- stretch {self.number}: started {self.started_at}, "
                                        f"from iteration {start_iteration} ---")

    def end(self, ended: str, end_iteration: int | None = None) -> None:
        """Record how it ended (:data:`ENDINGS`) and the last iteration it logged (read
        from rank 0's metrics file when not given)."""
        if ended not in ENDINGS:
            raise ValueError(f"a stretch ends {', '.join(ENDINGS)}, not {ended!r}")
        entry = {
            "stretch": self.number, "started_at": self.started_at, "start_iteration": self.start_iteration,
            "end_iteration": last_iteration(self.out, self.start_iteration) if end_iteration is None else end_iteration,
            "wall_s": round(time.perf_counter() - self.t0, 3), "ended": ended, "started_epoch": self.epoch0,
        }
        entries = [e for e in read(self.out) if e.get("stretch") != self.number] + [entry]
        write_output(self.out / FILE, (json.dumps(entries, indent=2) + "\n").encode())


def close_running(entries: list[dict[str, Any]], out: Path) -> list[dict[str, Any]]:
    """``entries`` with a stretch still marked running (its launch was killed before it
    ended it) closed as ``failed``: its last iteration and its time up to rank 0's last
    row, read from the metrics file."""
    for entry in entries:
        if entry.get("ended") == RUNNING:
            last, at = last_row(out)
            started = float(entry.get("started_epoch", 0.0))
            entry["end_iteration"] = max(last, int(entry.get("start_iteration", 0)))
            entry["wall_s"] = round(max(0.0, at - started), 3) if at and started else 0.0
            entry["ended"] = "failed"
    return entries


def last_iteration(out: Path, default: int = 0) -> int:
    """The last iteration rank 0 logged (its metrics file's last whole row)."""
    last, _ = last_row(out)
    return last if last else default


def last_row(out: Path) -> tuple[int, float]:
    """The iteration and ``t0`` of rank 0's last whole training row ((0, 0.0): none)."""
    try:
        with open(out / "metrics" / "rank-0.jsonl", "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return 0, 0.0
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "iteration" in row:
            return int(row["iteration"]), float(row.get("t0") or 0.0)
    return 0, 0.0


def apply(out: Path, summary: dict[str, Any]) -> None:
    """Put the run's stretches in ``summary``, and ``wall_s`` as their sum."""
    entries = read(out)
    if entries:
        summary["stretches"] = entries
        summary["wall_s"] = round(sum(float(e.get("wall_s", 0.0)) for e in entries), 3)
