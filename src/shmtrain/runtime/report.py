"""The end of a run: the time-breakdown table, ``summary.json`` and the PNG plot."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

ORDER = ["data", "forward", "backward", "update", "compute", "comm"]


def read_metrics(out: Path) -> dict[int, list[dict[str, Any]]]:
    """rank -> its JSONL rows."""
    rows: dict[int, list[dict[str, Any]]] = {}
    for file in sorted((out / "metrics").glob("rank-*.jsonl")):
        rank = int(file.stem.split("-")[1])
        rows[rank] = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    return rows


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


def plot(out: Path, rows: dict[int, list[dict[str, Any]]], title: str) -> Path:
    """Loss per iteration, and compute vs communication per iteration, to ``plot.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(11, 4))
    for rank, rank_rows in sorted(rows.items()):
        its = [r["iteration"] for r in rank_rows]
        ax_loss.plot(its, [r["loss"] for r in rank_rows], lw=0.8, label=f"rank {rank}")
    ax_loss.set(xlabel="iteration", ylabel="training loss", title="loss", yscale="log")
    ax_loss.legend(fontsize=7)
    rank0 = rows.get(0) or next(iter(rows.values()), [])
    its = [r["iteration"] for r in rank0]
    ax_time.plot(its, [r["time"].get("compute", 0) * 1e3 for r in rank0], lw=0.8, label="compute")
    ax_time.plot(its, [r["time"].get("comm", 0) * 1e3 for r in rank0], lw=0.8, label="communication")
    ax_time.set(xlabel="iteration", ylabel="ms", title="rank 0: compute vs communication", yscale="log")
    ax_time.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path = out / "plot.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summarize(out: Path, config: dict[str, Any], results: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Write ``summary.json`` and ``plot.png``; return the summary."""
    rows = read_metrics(out)
    means = phase_means(rows)
    rank0 = next(r for r in results if r["rank"] == 0)
    summary = {
        "strategy": config["strategy"],
        "workers": config.get("workers", len(results)),
        "workers_finished": len(results),
        "model": config["model"],
        "data": config["data"],
        "accuracy": rank0.get("accuracy"),
        "wall_s": wall_s,
        "train_s": max(r["wall_s"] for r in results),
        "iterations": rank0["iterations"],
        "iterations_per_rank": {r["rank"]: r["iterations"] for r in results},
        "final_loss": rank0.get("final_loss"),
        "phases_ms": {k: v * 1e3 for k, v in means.items()},
    }
    from shmtrain import strategies

    checks = strategies.get(config["strategy"]).check_metrics(rows)
    if checks:
        summary.update(checks)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(out, rows, f"{config['strategy']}, {len(results)} workers, {config['model']} on {config['data']}")
    return summary
