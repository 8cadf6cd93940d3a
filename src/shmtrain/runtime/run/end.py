"""How a run of ``shmtrain train`` ends and what it says: the summary, the table and the
plot (:func:`finish`), a stop that saved (:class:`RunStopped`, 128 + the signal), how to
continue, and a stretch's record."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

from shmtrain import strategies
from shmtrain.runtime.checkpoint import files as checkpoint_files
from shmtrain.runtime.config import TrainConfig
from shmtrain.runtime.files import OutputError
from shmtrain.runtime.outputs import report
from shmtrain.runtime.outputs.stretches import Stretch


class RunStopped(Exception):
    """The run stopped on request (Ctrl-C, SIGTERM); the message says what was saved and
    how to continue, ``code`` is the exit status (128 + the signal)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code

def warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)

def metric_text(summary: dict[str, Any]) -> str:
    """``held-out accuracy 97.50%``, or the task's metric (``held-out rmse 0.1234``)."""
    metric = summary.get("metric", "accuracy")
    value = summary.get(metric)
    if value is None:
        return f"held-out {metric} -"
    return f"held-out {metric} {value * 100:.2f}%" if metric == "accuracy" else f"held-out {metric} {value:.4g}"

def end_stretch(stretch: Stretch, ended: str) -> None:
    """Record how a stretch ended while a failure or stop is being reported: a file that
    cannot be written then (the disk that failed the worker is full) is one warning line,
    and the report stays the worker's own (its rank and its log)."""
    try:
        stretch.end(ended)
    except OutputError as exc:
        warn(f"shmtrain: warning: {exc}")

def resume_hint(out: Path) -> str:
    last = checkpoint_files.latest(out)
    return (f"the latest complete checkpoint is {last}; continue with: shmtrain train --resume {out}"
            if last else f"no checkpoint was written; start again with --out {out}")

def interrupted_message(out: Path, exc: KeyboardInterrupt) -> str:
    """What a stop that did not wait for the workers' checkpoint left: ``exc`` is a second
    signal (:class:`~shmtrain.runtime.launch.launcher.StopNow`: ``signum``, ``first``), or a
    Ctrl-C before the launcher's handlers were in place."""
    hint = resume_hint(out)
    signum = getattr(exc, "signum", signal.SIGINT)
    name = signal.Signals(signum).name
    if getattr(exc, "first", 0):
        first = signal.Signals(exc.first).name  # type: ignore[attr-defined]
        return (f"stopped at once by a second signal ({name}, after {first}): every worker was ended "
                f"without waiting for the checkpoint of the stop; {hint}")
    return f"interrupted by {name} before the workers were training; every worker has been ended; {hint}"

def stopped_message(out: Path, results: list[dict[str, Any]], signum: int) -> str:
    name = signal.Signals(signum).name
    its = sorted({r["iterations"] for r in results})
    at = f"iteration {its[0]}" if len(its) == 1 else f"iterations {its[0]}-{its[-1]}"
    saved = checkpoint_files.latest(out)
    return (f"interrupted by {name}: every worker stopped after {at} and saved {saved}; "
            f"continue with: shmtrain train --resume {out}")

def finish(out: Path, config: TrainConfig, results: list[dict[str, Any]], wall: float, echo) -> dict[str, Any]:
    summary = report.summarize(out, config.to_dict(), results, wall)
    echo("\nTime per iteration (mean over workers and iterations):")
    echo(report.breakdown_table({k: v / 1e3 for k, v in summary["phases_ms"].items()}))
    for line in strategies.get(config.strategy).describe_metrics(summary):
        echo(line)
    runs = len(summary.get("stretches", [])) or 1
    echo(f"\n{metric_text(summary)}  |  {summary['iterations']} iterations  |  "
         f"wall {summary['wall_s']:.1f} s" + (f" in {runs} stretches (this one {wall:.1f} s)" if runs > 1 else "")
         + f"  |  {out}/summary.json, {out}/plot.png")
    if summary.get("early_stopped") is not None:
        echo(f"early stop (--early-stop {config.early_stop}) after iteration {summary['early_stopped']}")
    if summary.get("best"):
        best = summary["best"]
        echo(f"best held-out {best['metric']} {best['value']:.4g} at iteration {best['iteration']}: {out}/best.pt")
    if summary.get("lost_workers"):
        echo("lost during the run (the others trained to the end): " + ", ".join(
            f"rank {r} after iteration {n}" for r, n in summary["lost_workers"].items()))
    if summary.get("skipped_files"):
        echo(f"skipped {summary['skipped_files']} unreadable image(s) (--skip-bad-files); each is "
             f"named in {out}/logs/rank-0.log")
    if config.trace:
        echo(f"timeline: {out}/trace.json (open in https://ui.perfetto.dev or chrome://tracing)")
    if config.tensorboard:
        echo(f"TensorBoard: tensorboard --logdir {out}/tensorboard")
    return summary
