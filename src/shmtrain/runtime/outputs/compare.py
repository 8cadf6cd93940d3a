"""``shmtrain compare RUN_DIR...``: finished runs side by side, a table and one figure.

The table has one line per run folder (from its ``summary.json``): strategy, workers,
iterations, the final held-out value of its task's primary metric (accuracy, rmse,
perplexity: ``runtime/tasks/``), wall seconds, and the mean ms per iteration of the main
phases. The figure (``--out``, default ``compare.png``) draws every run's training loss
(rank 0) and held-out metric (its ``eval`` rows, or the final value alone as one point) per
iteration, on shared axes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shmtrain.runtime import trusted_files
from shmtrain.runtime.files import figure_output
from shmtrain.runtime.outputs.report import metric_axis, read_evals, read_metrics

#: the phases the table shows (mean ms per iteration), in the loop's order
PHASES = ("data", "forward", "backward", "update", "comm", "iteration")


def load_run(folder: Path) -> dict[str, Any]:
    """A finished run: its summary, rank 0's iteration rows and its evaluations (the
    folder must be trusted, as every run folder a command reads:
    :mod:`shmtrain.runtime.trusted_files`)."""
    summary_file = folder / "summary.json"
    if not summary_file.is_file():
        what = "no such folder" if not folder.is_dir() else "it has no summary.json"
        raise ValueError(
            f"shmtrain compare {folder}: {what}; give run folders written by a finished "
            "shmtrain train (its --out, e.g. runs/<time>-<strategy>)"
        )
    trusted_files.check_folder(folder)
    try:
        summary = json.loads(trusted_files.read_bytes(summary_file, "run file"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"shmtrain compare {folder}: summary.json is not valid JSON ({exc}); "
                         "run the training again") from None
    rows = read_metrics(folder) if (folder / "metrics").is_dir() else {}
    evals = read_evals(folder) if (folder / "metrics").is_dir() else {}
    return {"folder": folder, "summary": summary, "rows": rows.get(0, []), "evals": evals.get(0, [])}


def labels(folders: list[Path]) -> list[str]:
    """Short names of the runs: folder names, or the paths as given when names repeat."""
    names = [f.name or str(f) for f in folders]
    return names if len(set(names)) == len(names) else [str(f) for f in folders]


def metric_of(summary: dict[str, Any]) -> str:
    """The run's primary held-out metric (``accuracy`` for runs from before tasks)."""
    return str(summary.get("metric") or "accuracy")


def _metric_cell(summary: dict[str, Any], named: bool) -> str:
    metric = metric_of(summary)
    value = summary.get(metric)
    if value is None:
        return "-"
    text = f"{value * 100:.2f}%" if metric == "accuracy" else f"{value:.4g}"
    return f"{metric} {text}" if named else text


def table(runs: list[dict[str, Any]], names: list[str]) -> str:
    """The runs side by side, one line each: each run's primary metric under its name
    (``accuracy``, ``rmse``, ``perplexity``), or under ``metric`` when the runs differ."""
    width = max(12, *(len(n) for n in names)) + 2
    metrics = {metric_of(run["summary"]) for run in runs}
    column = next(iter(metrics)) if len(metrics) == 1 else "metric"
    head = (f"{'run':<{width}}{'strategy':<11}{'workers':>8}{'iters':>8}{column:>18}{'wall s':>9}"
            + "".join(f"{p + ' ms':>13}" for p in PHASES))
    lines = [head, "-" * len(head)]
    for name, run in zip(names, runs, strict=True):
        s = run["summary"]
        ms = s.get("phases_ms", {})
        value = _metric_cell(s, column == "metric")
        lines.append(
            f"{name:<{width}}{s.get('strategy', '?')!s:<11}{s.get('workers', '?')!s:>8}"
            f"{s.get('iterations', '?')!s:>8}{value:>18}{_number(s.get('wall_s'), 1):>9}"
            + "".join(f"{_number(ms.get(p), 2):>13}" for p in PHASES)
        )
    return "\n".join(lines)


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def plot(runs: list[dict[str, Any]], names: list[str], path: Path) -> Path:
    """Training loss and held-out accuracy of every run in one figure, to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    metrics = {metric_of(run["summary"]) for run in runs}
    for i, (name, run) in enumerate(zip(names, runs, strict=True)):
        color = f"C{i % 10}"
        rows = run["rows"]
        ax_loss.plot([r["iteration"] for r in rows], [r["loss"] for r in rows], color=color, lw=0.8, label=name)
        evals, metric = run["evals"], metric_of(run["summary"])
        scale, _ = metric_axis(metric)
        label = name if len(metrics) == 1 else f"{name} ({metric})"
        if evals:
            ax_acc.plot([e["iteration"] for e in evals], [e.get(metric, float("nan")) * scale for e in evals], ".-",
                        color=color, lw=1.2, label=label)
        elif run["summary"].get(metric) is not None:
            ax_acc.plot([run["summary"].get("iterations", 0)], [run["summary"][metric] * scale], "o",
                        color=color, label=f"{label} (final)")
    ax_loss.set(xlabel="iteration", ylabel="training loss (rank 0)", title="loss", yscale="log")
    shown = next(iter(metrics)) if len(metrics) == 1 else "metric"
    ax_acc.set(xlabel="iteration", ylabel=metric_axis(shown)[1], title=f"held-out {shown}")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure_output(path, fig, dpi=110)
    plt.close(fig)
    return path


def compare(folders: list[Path], out: Path, echo=print) -> Path:
    """Print the table of ``folders`` and write the figure to ``out``; its path."""
    runs = [load_run(folder) for folder in folders]
    names = labels(folders)
    echo(table(runs, names))
    path = plot(runs, names, out)
    echo(f"\nloss and held-out metric curves: {path}")
    return path
