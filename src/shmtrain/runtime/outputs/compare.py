"""``shmtrain compare RUN_DIR...``: finished runs side by side, a table and one figure.

The table has one line per run folder (from its ``summary.json``): strategy, workers,
iterations, final held-out accuracy, wall seconds, and the mean ms per iteration of the
main phases. The figure (``--out``, default ``compare.png``) draws every run's training
loss (rank 0) and held-out accuracy (its ``eval`` rows, or the final accuracy alone as one
point) per iteration, on shared axes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shmtrain.runtime.outputs.files import figure_output
from shmtrain.runtime.outputs.report import read_evals, read_metrics

#: the phases the table shows (mean ms per iteration), in the loop's order
PHASES = ("data", "forward", "backward", "update", "comm", "iteration")


def load_run(folder: Path) -> dict[str, Any]:
    """A finished run: its summary, rank 0's iteration rows and its evaluations."""
    summary_file = folder / "summary.json"
    if not summary_file.is_file():
        what = "no such folder" if not folder.is_dir() else "it has no summary.json"
        raise ValueError(
            f"shmtrain compare {folder}: {what}; give run folders written by a finished "
            "shmtrain train (its --out, e.g. runs/<time>-<strategy>)"
        )
    try:
        summary = json.loads(summary_file.read_text())
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


def table(runs: list[dict[str, Any]], names: list[str]) -> str:
    """The runs side by side, one line each."""
    width = max(12, *(len(n) for n in names)) + 2
    head = (f"{'run':<{width}}{'strategy':<11}{'workers':>8}{'iters':>8}{'accuracy':>10}{'wall s':>9}"
            + "".join(f"{p + ' ms':>13}" for p in PHASES))
    lines = [head, "-" * len(head)]
    for name, run in zip(names, runs, strict=True):
        s = run["summary"]
        acc = s.get("accuracy")
        ms = s.get("phases_ms", {})
        accuracy = "-" if acc is None else f"{acc * 100:.2f}%"
        lines.append(
            f"{name:<{width}}{s.get('strategy', '?')!s:<11}{s.get('workers', '?')!s:>8}"
            f"{s.get('iterations', '?')!s:>8}{accuracy:>10}{_number(s.get('wall_s'), 1):>9}"
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
    for i, (name, run) in enumerate(zip(names, runs, strict=True)):
        color = f"C{i % 10}"
        rows = run["rows"]
        ax_loss.plot([r["iteration"] for r in rows], [r["loss"] for r in rows], color=color, lw=0.8, label=name)
        evals = run["evals"]
        if evals:
            ax_acc.plot([e["iteration"] for e in evals], [e["accuracy"] * 100 for e in evals], ".-",
                        color=color, lw=1.2, label=name)
        elif run["summary"].get("accuracy") is not None:
            ax_acc.plot([run["summary"].get("iterations", 0)], [run["summary"]["accuracy"] * 100], "o",
                        color=color, label=f"{name} (final)")
    ax_loss.set(xlabel="iteration", ylabel="training loss (rank 0)", title="loss", yscale="log")
    ax_acc.set(xlabel="iteration", ylabel="accuracy (%)", title="held-out accuracy")
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
    echo(f"\nloss and accuracy curves: {path}")
    return path
