"""Model selection on rank 0's held-out evaluations: ``--keep-best METRIC`` and
``--early-stop METRIC:PATIENCE``.

After each evaluation (``runtime/run/monitor.py``) :meth:`Selection.after_eval`

- with ``--keep-best``: when the metric improves on the best so far (larger accuracy,
  smaller loss, rmse or perplexity: :meth:`shmtrain.runtime.tasks.base.Task.better`),
  writes the evaluated model's ``state_dict`` (the job's model: W_g for the asynchronous
  strategies) to ``RUN_DIR/best.pt`` and its evaluation to ``RUN_DIR/best.json``, each
  atomically; a resumed run starts from the best that ``best.json`` records;
- with ``--early-stop``: after PATIENCE evaluations in a row without improvement, asks
  every rank to stop through the stop request of Ctrl-C (``runtime/train/stop.py``:
  every rank stops at one agreed iteration and saves a checkpoint), with
  :data:`shmtrain.runtime.train.stop.EARLY_STOP` as its code; the run then finishes as a
  finished run does (final evaluation, ``model.pt``, exit status 0) and ``summary.json``
  says ``early_stopped``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from shmtrain.runtime.files import save_output, write_output
from shmtrain.runtime.tasks.base import Task
from shmtrain.runtime.train.finite import json_text


def parse_early_stop(text: str) -> tuple[str, int]:
    """``METRIC:PATIENCE`` -> (metric, patience); ValueError naming the fix."""
    metric, sep, patience = text.partition(":")
    if not sep or not metric or not patience.strip().isdigit() or int(patience) < 1:
        raise ValueError(f"--early-stop {text!r}: write METRIC:PATIENCE, the held-out metric and the "
                         "evaluations without improvement to stop after (at least 1), e.g. --early-stop loss:3")
    return metric.strip(), int(patience)


class Selection:
    """Rank 0's best model and early stop (module docstring)."""

    def __init__(self, out: Path, task: Task, keep_best: str | None, early_stop: str | None,
                 request_stop: Callable[[], None]) -> None:
        self.out, self.task = out, task
        self.keep_best = keep_best
        self.watch, self.patience = parse_early_stop(early_stop) if early_stop else (None, 0)
        self.request_stop = request_stop
        self.best: float | None = None
        self.watched_best: float | None = None
        self.without_improvement = 0
        #: the iteration at which the early stop was asked for (None: not asked)
        self.asked: int | None = None
        saved = out / "best.json"
        if keep_best and saved.is_file():  # a resumed run: the best so far
            try:
                record = json.loads(saved.read_text())
                if record.get("metric") == keep_best:
                    self.best = record.get("value")
            except (OSError, ValueError):
                pass

    @property
    def active(self) -> bool:
        return bool(self.keep_best or self.watch)

    def after_eval(self, entry: dict[str, Any], model: nn.Module) -> None:
        """Update the best model and the early-stop count with an evaluation ``entry``."""
        if self.keep_best:
            value = entry.get(self.keep_best)
            if self.task.better(self.keep_best, value, self.best):
                self.best = value
                save_output(self.out / "best.pt", model.state_dict())
                record = {"metric": self.keep_best, "value": value, "iteration": entry["iteration"],
                          "metrics": {k: v for k, v in entry.items() if k not in ("t0", "time")}}
                write_output(self.out / "best.json", (json_text(record, indent=2) + "\n").encode())
        if self.watch and self.asked is None:
            value = entry.get(self.watch)
            if self.task.better(self.watch, value, self.watched_best):
                self.watched_best, self.without_improvement = value, 0
            else:
                self.without_improvement += 1
                if self.without_improvement >= self.patience:
                    self.asked = entry["iteration"]
                    self.request_stop()
