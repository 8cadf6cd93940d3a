"""The rows of ``shmtrain bench hosts``: one job's row from its run folder, a method's
row over its rounds, the choice of a method's grid point, the table and the plot.

Every number here is read from the files the job wrote (``metrics/rank-<r>.jsonl``) and
from what the bench counted around it (launch time, wall time, the veth's byte
counters), so a row can be rebuilt from a run folder.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from shmtrain.bench.common import table

#: the per-run numbers a method's row gives as the median over its rounds
MEDIAN_KEYS = ("time_to_target_s", "train_time_to_target_s", "iterations_to_target", "final_accuracy",
               "best_accuracy", "iterations", "comm_ms", "compute_ms", "iteration_ms", "comm_share",
               "startup_s", "wall_s", "train_s", "link_mb", "link_kb_per_iteration", "loadavg_1m")


def startup_phases(logs: list[Path], start: float) -> dict[str, float]:
    """Seconds from the launch until every worker had passed each start-up mark
    (:mod:`shmtrain.startup`; the last worker's time per phase), in the marks' order."""
    from shmtrain.startup import read_marks

    phases: dict[str, float] = {}
    for marks in read_marks(logs).values():
        for phase, t in marks.items():
            phases[phase] = max(phases.get(phase, 0.0), round(t - start, 3))
    return dict(sorted(phases.items(), key=lambda item: item[1]))


def summarize(method: str, out: Path, start: float, wall: float, target: float, link: int = 0,
              per_node: int = 2, logs: list[Path] | None = None) -> dict[str, Any]:
    """A job's row from its run folder: rank 0's evaluations (of the job's model: W_g or
    θ^(t) where the method has one, ``evaluated``) against seconds since ``start`` (the
    launch), the iterations of every rank and host, the start-up of every host and the
    ``link`` bytes counted on the veth."""
    from shmtrain.runtime.outputs.report import phase_means, read_evals, read_metrics

    evals = read_evals(out).get(0, [])
    rows = read_metrics(out)
    curve = [(e["t0"] - start, e["accuracy"], e["iteration"]) for e in evals]
    hit = next((c for c in curve if c[1] >= target), None)
    per_rank = {rank: max((r["iteration"] for r in rank_rows), default=0) for rank, rank_rows in rows.items()}
    firsts = {rank: min((r["t0"] for r in rank_rows), default=start) for rank, rank_rows in rows.items()}
    hosts = sorted({rank // per_node for rank in rows})
    per_host = [[r for r in sorted(rows) if r // per_node == h] for h in hosts]
    startup = [round(min(firsts[r] for r in ranks) - start, 3) for ranks in per_host]
    ends = [r["t0"] + r["time"].get("iteration", 0.0) for rank_rows in rows.values() for r in rank_rows]
    means = phase_means(rows)
    iteration_s = means.get("iteration", 0.0)
    mean_iterations = statistics.mean(per_rank.values()) if per_rank else 0
    return {
        "method": method,
        "evaluated": "global" if any(e.get("weights") == "global" for e in evals) else "rank 0",
        "time_to_target_s": round(hit[0], 3) if hit else None,
        "train_time_to_target_s": round(hit[0] - startup[0], 3) if hit and startup else None,
        "iterations_to_target": hit[2] if hit else None,
        "final_accuracy": curve[-1][1] if curve else None,
        "best_accuracy": max((c[1] for c in curve), default=None),
        "iterations": per_rank.get(0, 0),
        "iterations_per_rank": [per_rank[r] for r in sorted(per_rank)],
        "iterations_per_host": [round(statistics.mean(per_rank[r] for r in ranks)) for ranks in per_host],
        "comm_ms": round(means.get("comm", 0.0) * 1e3, 3),
        "compute_ms": round(means.get("compute", 0.0) * 1e3, 3),
        "iteration_ms": round(iteration_s * 1e3, 3),
        "comm_share": round(means.get("comm", 0.0) / iteration_s, 4) if iteration_s else None,
        "startup_s": max(startup) if startup else None,  # launch to the first iteration on every host
        "startup_per_host_s": startup,
        "startup_phases_s": startup_phases(logs or [], start),
        "wall_s": round(wall, 3),
        # the first iteration anywhere to the last one's end anywhere (Table II's training time)
        "train_s": round(max(ends) - min(firsts.values()), 3) if ends else None,
        "link_mb": round(link / 1e6, 3),
        "link_kb_per_iteration": round(link / 1e3 / mean_iterations, 3) if mean_iterations else None,
        "curve": [{"s": round(s, 3), "accuracy": acc, "iteration": it} for s, acc, it in curve],
    }


def combine(method: str, runs: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A method's row over its rounds: the median of each number (of the time to target
    only when every round reached it, else None), the spread, per-host iterations and
    start-ups (medians per host), and every round's row; ``extra`` (the chosen grid
    point, ...) is copied in."""
    row: dict[str, Any] = {"method": method, **(extra or {}), "rounds": len(runs),
                           "reached": sum(r["time_to_target_s"] is not None for r in runs),
                           "evaluated": runs[0].get("evaluated", "rank 0") if runs else None}
    for key in MEDIAN_KEYS:
        values = [r.get(key) for r in runs if r.get(key) is not None]
        row[key] = statistics.median(values) if values and len(values) == len(runs) else None
    for key in ("iterations_per_host", "startup_per_host_s"):
        columns = list(zip(*(r.get(key) or [] for r in runs), strict=False))
        row[key] = [statistics.median(c) for c in columns] if runs and all(r.get(key) for r in runs) else None
    times = [r["time_to_target_s"] for r in runs if r["time_to_target_s"] is not None]
    row["time_to_target_range_s"] = [min(times), max(times)] if times else None
    row["runs"] = runs
    return row


def score(row: dict[str, Any]) -> tuple[int, float]:
    """How a grid point ranks (smaller is better): reaching the target first, then the
    sooner; a point that never reaches it ranks by its best accuracy."""
    if row["time_to_target_s"] is not None:
        return (0, row["time_to_target_s"])
    return (1, -(row.get("best_accuracy") or 0.0))


def pick(trials: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """The grid point (its overrides) whose trial run scored best (:func:`score`); the
    first listed wins a tie."""
    return min(trials, key=lambda trial: score(trial[1]))[0]


def rotated(methods: list[str], round_: int) -> list[str]:
    """Round ``round_``'s order: the methods rotated by ``round_`` places, so each method
    runs first, second, ... in turn (a change in the machine's load falls on all)."""
    shift = round_ % len(methods) if methods else 0
    return methods[shift:] + methods[:shift]


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def print_table(rows: list[dict[str, Any]], repeat: int) -> str:
    """The table of one setting: a row per method (the one-host run included)."""
    view = []
    for row in rows:
        shown = dict(row)
        shown["per_host"] = "/".join(_cell(v, ".0f") for v in row.get("iterations_per_host") or []) or "-"
        shown["startups"] = "/".join(_cell(v, ".1f") for v in row.get("startup_per_host_s") or []) or "-"
        shown["chosen"] = " ".join(f"{k}={v}" for k, v in (row.get("grid_point") or {}).items()) or "-"
        shown["share"] = None if row.get("comm_share") is None else 100 * row["comm_share"]
        view.append(shown)
    return table(view, [("method", "method", "s"), ("chosen", "grid point", "s"),
                        ("evaluated", "evaluated", "s"), ("time_to_target_s", "s to target", ".1f"),
                        ("train_time_to_target_s", "after start", ".1f"), ("best_accuracy", "best acc", ".4f"),
                        ("final_accuracy", "final acc", ".4f"), ("per_host", "iters a/b", "s"),
                        ("comm_ms", "comm ms/it", ".1f"), ("share", "comm %", ".0f"),
                        ("iteration_ms", "iter ms", ".1f"), ("link_mb", "link MB", ".1f"),
                        ("link_kb_per_iteration", "link kB/it", ".0f"), ("startups", "startup a/b s", "s"),
                        ("wall_s", "wall s", ".1f"), *([("reached", "reached", "d")] if repeat > 1 else [])])


def plot(rows: list[dict[str, Any]], target: float, title: str, path: Path) -> None:
    """Held-out accuracy of the job's model against wall time since launch, one colour per
    method (ShmCaffe Figs. 8-12); with several rounds, the first is drawn bold and the
    others faint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    for n, row in enumerate(rows):
        reached = "not reached" if row["time_to_target_s"] is None else f"{row['time_to_target_s']:.1f} s"
        if row["rounds"] > 1:
            reached = f"median {reached}, {row['reached']}/{row['rounds']} rounds"
        for k, run in enumerate(row["runs"]):
            ax.plot([c["s"] for c in run["curve"]], [c["accuracy"] for c in run["curve"]], color=f"C{n}",
                    marker="." if k == 0 else None, ms=3, lw=1.2 if k == 0 else 0.7, alpha=1.0 if k == 0 else 0.35,
                    label=f"{row['method']} ({reached})" if k == 0 else None)
    ax.axhline(target, color="grey", ls="--", lw=0.8)
    ax.set(xlabel="wall time since launch (s)", ylabel="held-out accuracy (the job's model)", title=title,
           ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=7, title=f"time to {target:.0%}", title_fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
