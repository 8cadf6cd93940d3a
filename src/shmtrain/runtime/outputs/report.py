"""The end of a run: the time-breakdown table, ``summary.json``, the PNG plot, ``trace.json``.

``metrics/rank-<r>.jsonl`` holds one row per iteration (``iteration``, ``loss``, ``lr``,
``t0``, ``time``) and, in rank 0's file, ``{"eval": {...}}`` rows of the held-out
evaluations; :func:`read_metrics` returns the iteration rows only, :func:`read_evals`
the evaluations.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from shmtrain.runtime.files import figure_output, write_output
from shmtrain.runtime.outputs import stretches
from shmtrain.runtime.train.finite import json_text

ORDER = ["data", "forward", "backward", "update", "compute", "comm"]


def read_rows(out: Path) -> dict[int, list[dict[str, Any]]]:
    """rank -> every JSONL row of its metrics file (iterations and evaluations)."""
    rows: dict[int, list[dict[str, Any]]] = {}
    for file in sorted((out / "metrics").glob("rank-*.jsonl")):
        rank = int(file.stem.split("-")[1])
        rows[rank] = []
        for number, line in enumerate(file.read_bytes().decode(errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows[rank].append(json.loads(line))
            except ValueError as exc:  # a line a full disk cut short: the rest still counts
                print(f"shmtrain: warning: {file} line {number} is not JSON ({exc}); left out",
                      file=sys.stderr)
    return rows


def read_metrics(out: Path) -> dict[int, list[dict[str, Any]]]:
    """rank -> its iteration rows (the ``eval`` rows are left out: :func:`read_evals`)."""
    return {rank: [r for r in rows if "eval" not in r] for rank, rows in read_rows(out).items()}


def read_evals(out: Path) -> dict[int, list[dict[str, Any]]]:
    """rank -> its held-out evaluations (``iteration``, ``loss``, the task's metrics, e.g.
    ``accuracy``, ``t0``, ``time``); only rank 0 evaluates, so other ranks have none."""
    evals = {rank: [r["eval"] for r in rows if "eval" in r] for rank, rows in read_rows(out).items()}
    return {rank: entries for rank, entries in evals.items() if entries}


def phase_means(rows: dict[int, list[dict[str, Any]]], skip: int = 1) -> dict[str, float]:
    """Mean seconds per iteration of every phase, over ranks and iterations (the first
    ``skip`` iterations of each rank are warm-up and left out when there are more)."""
    sums: dict[str, list[float]] = {}
    for rank_rows in rows.values():
        use = rank_rows[skip:] if len(rank_rows) > skip else rank_rows
        for row in use:
            for name, seconds in row["time"].items():
                sums.setdefault(name, []).append(seconds)
    return {name: statistics.fmean(values) for name, values in sums.items()}


def breakdown_table(means: dict[str, float]) -> str:
    """Phases in ms per iteration and as a share of the iteration."""
    total = means.get("iteration") or sum(means.get(p, 0.0) for p in ("data", "compute", "comm"))
    names = [p for p in ORDER if p in means] + sorted(set(means) - set(ORDER) - {"iteration"})
    lines = [f"{'phase':<20}{'ms/iter':>10}{'share':>8}"]
    for name in names:
        lines.append(f"{name:<20}{means[name] * 1e3:>10.2f}{means[name] / total * 100 if total else 0:>7.1f}%")
    lines.append(f"{'iteration':<20}{total * 1e3:>10.2f}{100.0:>7.1f}%")
    return "\n".join(lines)


def metric_axis(metric: str) -> tuple[float, str]:
    """(scale, axis label) of a held-out metric: accuracy in percent, others as they are."""
    return (100.0, "accuracy (%)") if metric == "accuracy" else (1.0, metric)


def plot(out: Path, rows: dict[int, list[dict[str, Any]]], title: str,
         evals: dict[int, list[dict[str, Any]]] | None = None, metric: str = "accuracy") -> Path:
    """Loss per iteration (with the held-out loss), the task's held-out ``metric`` when the
    run evaluated, and compute vs communication per iteration, to ``plot.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    held_out = (evals or {}).get(0, [])
    panels = 3 if held_out else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4))
    ax_loss, ax_time = axes[0], axes[-1]
    for rank, rank_rows in sorted(rows.items()):
        its = [r["iteration"] for r in rank_rows]
        ax_loss.plot(its, [r["loss"] for r in rank_rows], lw=0.8, label=f"rank {rank}")
    if held_out:
        its = [e["iteration"] for e in held_out]
        ax_loss.plot(its, [e["loss"] for e in held_out], "k.-", lw=1.2, label="held-out (rank 0)")
        ax_acc = axes[1]
        scale, label = metric_axis(metric)
        values = [e.get(metric) for e in held_out]
        ax_acc.plot(its, [v * scale if v is not None else float("nan") for v in values], "C2.-", lw=1.2)
        ax_acc.set(xlabel="iteration", ylabel=label, title=f"held-out {metric} (rank 0)")
        ax_acc.grid(alpha=0.3)
    ax_loss.set(xlabel="iteration", ylabel="loss", title="loss", yscale="log")
    ax_loss.legend(fontsize=7)
    rank0 = rows.get(0) or next(iter(rows.values()), [])
    its = [r["iteration"] for r in rank0]
    ax_time.plot(its, [r["time"].get("compute", 0) * 1e3 for r in rank0], lw=0.8, label="compute")
    ax_time.plot(its, [r["time"].get("comm", 0) * 1e3 for r in rank0], lw=0.8, label="communication")
    ax_time.set(xlabel="iteration", ylabel="ms", title="rank 0: compute vs communication", yscale="log")
    ax_time.legend(fontsize=7)
    fig.suptitle(title)
    # fixed margins: tight_layout measures every text extent (~0.7 s of a 1-iteration run)
    fig.subplots_adjust(left=0.07 if panels == 3 else 0.1, right=0.98, bottom=0.13, top=0.85, wspace=0.3)
    path = out / "plot.png"
    try:
        figure_output(path, fig, dpi=110)
    finally:
        plt.close(fig)
    return path


def summarize(out: Path, config: dict[str, Any], results: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Write ``summary.json``, then ``plot.png`` (and ``trace.json`` when ``config["trace"]``),
    each atomically (``runtime/files.py``): the numbers of a finished run are on disk before
    anything optional; return the summary."""
    previous = out / "summary.json"
    if previous.is_file() and results and not any(r.get("trained", 1) for r in results):
        try:  # a finished run resumed at its total: nothing new to report but its stretches
            kept = json.loads(previous.read_text())
            stretches.apply(out, kept)
            write_output(previous, (json_text(kept, indent=2) + "\n").encode())
            return kept
        except (OSError, ValueError):
            pass  # unreadable: written anew below
    rows = read_metrics(out)
    evals = read_evals(out)
    means = phase_means(rows)
    rank0 = next(r for r in results if r["rank"] == 0)
    metric = rank0.get("metric", "accuracy")
    summary = {
        "strategy": config["strategy"],
        "workers": config.get("workers", len(results)),
        "workers_finished": len(results),
        "model": config["model"],
        "data": config["data"],
        # where each rank computed (``--device``: auto resolves in the workers)
        "devices": {r["rank"]: r["device"] for r in results if "device" in r},
        "accuracy": rank0.get("accuracy"),
        # what the run learned (runtime/tasks/): its primary held-out metric, and all of them
        "task": rank0.get("task", "classification"),
        "metric": metric,
        "metrics": rank0.get("metrics"),
        # model.pt: the job's model (asynchronous strategies: the global weights W_g, rank
        # 0's own beside it in model-rank0.pt, with its accuracy)
        "model_pt": rank0.get("model", "rank 0's weights (the same on every worker)"),
        "accuracy_rank0_local": rank0.get("accuracy_rank0_local"),
        **({metric: rank0.get(metric), f"{metric}_rank0_local": rank0.get(f"{metric}_rank0_local")}
           if metric != "accuracy" else {}),
        "wall_s": wall_s,
        "train_s": max(r["wall_s"] for r in results),
        "iterations": rank0["iterations"],
        "iterations_per_rank": {r["rank"]: r["iterations"] for r in results},
        "final_loss": rank0.get("final_loss"),
        "held_out_loss": evals[0][-1]["loss"] if evals.get(0) else None,
        # --early-stop: the iteration every worker stopped at (None: the run went to its end)
        "early_stopped": rank0.get("early_stopped"),
        "evaluations": len(evals.get(0, [])),
        "phases_ms": {k: v * 1e3 for k, v in means.items()},
    }
    from shmtrain import strategies

    checks = strategies.get(config["strategy"]).check_metrics(rows)
    if checks:
        summary.update(checks)
    # workers lost during an asynchronous run, with the iterations each had done (from the
    # progress board; from its metrics rows when the board never heard of it)
    lost = {int(r): int(n) for r, n in (rank0.get("lost") or {}).items()}
    lost.update({r: -1 for r in range(summary["workers"]) if r not in lost and r not in summary["iterations_per_rank"]})
    summary["lost_workers"] = {
        str(r): n if n >= 0 else (rows[r][-1]["iteration"] if rows.get(r) else 0) for r, n in sorted(lost.items())
    }
    for r, n in summary["lost_workers"].items():  # every rank's count, the lost ones' too
        summary["iterations_per_rank"].setdefault(int(r), n)
    summary["iterations_per_rank"] = dict(sorted(summary["iterations_per_rank"].items()))
    stretches.apply(out, summary)  # a resumed run: wall_s over every stretch, and the list
    best = out / "best.json"  # --keep-best: the best evaluation's model is best.pt
    if best.is_file():
        try:
            summary["best"] = json.loads(best.read_text())
        except ValueError:
            pass
    skipped = sorted({f for r in results for f in r.get("skipped_files", [])})
    summary["skipped_files"] = len(skipped)  # --skip-bad-files: each is named in the logs
    write_output(out / "summary.json", (json_text(summary, indent=2) + "\n").encode())
    plot(out, rows, f"{config['strategy']}, {len(results)} workers, {config['model']} on {config['data']}",
         evals, metric)
    if config.get("trace"):
        from shmtrain.runtime.outputs.trace import write_trace

        write_trace(out, rows, evals)
    return summary
