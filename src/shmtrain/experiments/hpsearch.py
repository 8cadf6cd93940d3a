"""HP-SEARCH: batch size x learning rate at a constant number of samples seen, per worker
count, ranked by the area under the loss curve among runs that reach a loss threshold.

SHM-Learn-Dist Section 5 (Figs. 5.1-5.8, Table 5.1): every run sees the same number of
training samples (307,200 in the paper, so iterations = samples / (workers x batch));
runs whose minimum loss is not <= the threshold (1.8 there, for CIFAR-10) are dropped;
the winner per worker count is the run with the smallest area under its loss curve
against wall time ("performance w.r.t. time"). Here the data set is scikit-learn's
digits, the model a registry model (``mlp`` by default), and the training the real
``ps_grad`` strategy (eq. 2.1) in real worker processes, one launch per worker count.

Diverged runs (non-finite weights: every worker sees the server's weights, so all stop
at the same step) and runs above the threshold are drawn as such in the heat maps,
never as zero areas that would look like winners.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

PAPER_GRID = {
    "workers": (1, 2, 4, 8),
    "batch_sizes": (16, 32, 64, 128, 256, 512),
    "lrs": (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9),
    "samples": 307_200,
}
AREA_OVER = ("time", "samples")


@dataclass
class SearchConfig:
    """Options of ``shmtrain experiment hpsearch`` (defaults: a grid this machine runs in
    a few minutes; :data:`PAPER_GRID` with ``--full``)."""

    workers: tuple[int, ...] = (1, 2, 4)
    batch_sizes: tuple[int, ...] = (16, 64, 256)
    lrs: tuple[float, ...] = (0.1, 0.5, 0.9)
    samples: int = 16_384
    threshold: float = 0.3
    model: str = "mlp"
    area_over: str = "time"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("workers", "batch_sizes"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"--{name.replace('_', '-')} {','.join(map(str, values)) or '(empty)'}: "
                                 "give a comma-separated list of integers >= 1")
        if not self.lrs or any(not (isinstance(v, int | float) and math.isfinite(v) and v > 0) for v in self.lrs):
            raise ValueError(f"--lrs {','.join(map(str, self.lrs)) or '(empty)'}: learning rates must be "
                             "finite numbers > 0, e.g. 0.1,0.5,0.9")
        if not isinstance(self.samples, int) or self.samples < 1:
            raise ValueError(f"--samples {self.samples!r} must be an integer >= 1 (training samples seen per run)")
        if not (math.isfinite(self.threshold) and self.threshold > 0):
            raise ValueError(f"--threshold {self.threshold!r} must be a finite loss > 0 (the paper uses 1.8 "
                             "for CIFAR-10; digits' cross-entropy starts near 2.3)")
        if self.area_over not in AREA_OVER:
            raise ValueError(f"--area-over {self.area_over!r}: choose {' or '.join(AREA_OVER)}")


def grid_points(cfg: SearchConfig, train_size: int) -> tuple[dict[int, list[dict[str, Any]]], list[dict[str, Any]]]:
    """Valid points per worker count, and the invalid ones with the reason."""
    valid: dict[int, list[dict[str, Any]]] = {}
    invalid = []
    for n in cfg.workers:
        for b in cfg.batch_sizes:
            iterations = cfg.samples // (n * b)
            reason = None
            if n * b > train_size:
                reason = f"{n} workers x batch {b} = {n * b} samples per step > the {train_size} training samples"
            elif iterations < 2:
                reason = f"{cfg.samples} samples / ({n} x {b}) = {iterations} iteration(s): a curve needs >= 2"
            for lr in cfg.lrs:
                point = {"workers": n, "batch": b, "lr": float(lr), "iterations": iterations}
                if reason:
                    invalid.append({**point, "reason": reason})
                else:
                    valid.setdefault(n, []).append(point)
    return valid, invalid


def search_worker(ctx, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """One worker: train every grid point of this worker count with ps_grad, in turn."""
    from shmtrain.models import build_model
    from shmtrain.parallel.data_parallel import DataParallel
    from shmtrain.runtime.data.tensors import ShardSampler, load_digits_data

    data = load_digits_data()
    out = []
    for point in payload["points"]:
        torch.manual_seed(payload["seed"])
        net = build_model(payload["model"], data.input_shape, data.num_classes)
        opt = torch.optim.SGD(net.parameters(), lr=point["lr"])
        dp = DataParallel(net, opt, "ps_grad", ctx=ctx)
        # One seed for every point: runs with the same union batch (workers x batch) see the
        # same samples in the same order, so ps_grad gives them the same loss curve (eq. 2.1
        # is SGD on the union batch) and they differ only in time.
        sampler = ShardSampler(len(data.train_x), point["batch"], ctx.world_size, ctx.rank, payload["seed"])
        losses, times, diverged = [], [], False
        start = time.perf_counter()
        for it in range(point["iterations"]):
            idx = sampler.indices(it)
            dp.zero_grad()
            loss = nn.functional.cross_entropy(dp(data.train_x[idx]), data.train_y[idx])
            loss.backward()
            dp.step()
            losses.append(loss.item())
            times.append(time.perf_counter() - start)
            # every worker reads the server's weights, so every worker stops at the same step
            if not bool(torch.isfinite(dp.strategy.weights).all()):
                diverged = True
                break
        accuracy = None
        if ctx.rank == 0 and not diverged:
            with torch.no_grad():
                accuracy = float((net(data.test_x).argmax(1) == data.test_y).float().mean())
        dp.close()
        out.append({"losses": losses, "times": times, "diverged": diverged, "accuracy": accuracy})
    return out


def _area(loss: np.ndarray, x: np.ndarray) -> float:
    return float(np.trapezoid(loss, x)) if len(loss) > 1 else float("nan")


def evaluate(point: dict[str, Any], results: list[dict[str, Any]], cfg: SearchConfig) -> dict[str, Any]:
    """Combine the workers' results of one grid point: the loss of the union batch per
    iteration, its minimum, its area (over rank 0's wall time or samples seen)."""
    length = min(len(r["losses"]) for r in results)
    loss = np.mean([r["losses"][:length] for r in results], axis=0)
    times = np.asarray(results[0]["times"][:length])
    seen = (np.arange(length) + 1) * point["workers"] * point["batch"]
    finite = bool(np.all(np.isfinite(loss)))
    diverged = any(r["diverged"] for r in results) or not finite
    first = float(loss[0]) if length else float("nan")
    if finite and length and loss[-max(1, length // 10):].mean() > 10 * first:
        diverged = True  # blew up without reaching inf/nan
    row = {**point, "diverged": diverged, "seconds": float(times[-1]) if length else 0.0,
           "loss": loss.tolist(), "time": times.tolist(), "accuracy": results[0]["accuracy"]}
    if diverged:
        row.update(min_loss=None, area_time=None, area_samples=None, status="diverged")
    else:
        row.update(min_loss=float(loss.min()), area_time=_area(loss, times), area_samples=_area(loss, seen),
                   status="kept" if loss.min() <= cfg.threshold else "above threshold")
    return row


def run_hpsearch(out: Path, cfg: SearchConfig | None = None, *, log=print) -> dict[str, Any]:
    """Run the search; write ``hpsearch.json`` and the PNGs into ``out``; return the JSON.

    Raises:
        ValueError: bad options, no valid grid point, or a threshold every run misses
            (the JSON with every run's numbers is written first).
    """
    from shmtrain.models import model_names
    from shmtrain.runtime.data.tensors import load_digits_data
    from shmtrain.runtime.launch.launcher import launch

    cfg = cfg or SearchConfig()
    if cfg.model not in model_names():
        raise ValueError(f"--model {cfg.model!r} is unknown; choose one of: {', '.join(model_names())}")
    train_size = len(load_digits_data().train_x)
    valid, invalid = grid_points(cfg, train_size)
    if not valid:
        reasons = sorted({p["reason"] for p in invalid})
        raise ValueError("the grid has no valid point: " + "; ".join(reasons[:4])
                         + " (use smaller --batch-sizes / fewer --workers, or more --samples)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    runs = []
    for n, points in valid.items():
        t0 = time.perf_counter()
        payload = {"points": points, "seed": cfg.seed, "model": cfg.model}
        results = launch("shmtrain.experiments.hpsearch:search_worker", n, payload, timeout=600)
        for k, point in enumerate(points):
            runs.append(evaluate(point, [r[k] for r in results], cfg))
        log(f"hpsearch: {n} worker(s), {len(points)} runs, {time.perf_counter() - t0:.1f} s")
    area_key = f"area_{cfg.area_over}"
    best = {}
    for n in valid:
        kept = [r for r in runs if r["workers"] == n and r["status"] == "kept"]
        if kept:
            winner = min(kept, key=lambda r: r[area_key])
            winner["best"] = True
            best[str(n)] = {k: winner[k] for k in ("batch", "lr", "min_loss", area_key, "accuracy", "iterations")}
    doc = {"config": asdict(cfg), "train_size": train_size, "runs": runs, "invalid": invalid, "best": best,
           "total_seconds": time.perf_counter() - started}
    (out / "hpsearch.json").write_text(json.dumps(doc) + "\n")
    if not best:
        lowest = min((r for r in runs if r["min_loss"] is not None), key=lambda r: r["min_loss"], default=None)
        hint = ("every run diverged" if lowest is None else
                f"the lowest minimum loss was {lowest['min_loss']:.4f} (workers {lowest['workers']}, "
                f"batch {lowest['batch']}, lr {lowest['lr']}); use a --threshold above it")
        raise ValueError(f"--threshold {cfg.threshold} excludes every run: {hint}. The runs' numbers "
                         f"are in {out / 'hpsearch.json'}; no plot was drawn")
    plot(doc, out)
    log(table(doc))
    log(f"wrote {out / 'hpsearch.json'}, {out / 'hpsearch_heatmaps.png'}, {out / 'hpsearch_areas.png'}, "
        f"{out / 'hpsearch_best_losses.png'}")
    return doc


def table(doc: dict[str, Any]) -> str:
    """Table 5.1 analogue: the best batch size and learning rate per worker count."""
    key = f"area_{doc['config']['area_over']}"
    lines = [f"{'workers':>7} {'batch':>6} {'lr':>5} {'min loss':>9} {key:>12} {'accuracy':>9}"]
    for n, b in doc["best"].items():
        acc = "-" if b["accuracy"] is None else f"{100 * b['accuracy']:.1f}%"
        lines.append(f"{n:>7} {b['batch']:>6} {b['lr']:>5} {b['min_loss']:>9.4f} {b[key]:>12.3f} {acc:>9}")
    counts = {s: sum(r["status"] == s for r in doc["runs"]) for s in ("kept", "above threshold", "diverged")}
    lines.append(f"runs: {len(doc['runs'])} ({', '.join(f'{v} {k}' for k, v in counts.items())}); "
                 f"invalid grid points: {len(doc['invalid'])}")
    return "\n".join(lines)


def plot(doc: dict[str, Any], out: Path) -> None:
    """Heat maps per worker count (Figs. 5.5-5.8), areas sorted by minimum loss (Figs.
    5.1-5.4) and the winners' loss curves."""
    import matplotlib

    matplotlib.use("Agg")
    _plot_heatmaps(doc, out)
    _plot_areas(doc, out)
    _plot_best_losses(doc, out)


def _area_key(cfg: dict[str, Any]) -> tuple[str, str]:
    """The runs' field of the area the search ranks by, and its unit."""
    key = f"area_{cfg['area_over']}"
    unit = "loss x s" if cfg["area_over"] == "time" else "loss x samples"
    return key, unit


def _by_point(doc: dict[str, Any]) -> dict[tuple[int, int, float], dict[str, Any]]:
    """Every run by its grid point (workers, batch, learning rate)."""
    return {(r["workers"], r["batch"], r["lr"]): r for r in doc["runs"]}


def _plot_heatmaps(doc: dict[str, Any], out: Path) -> None:
    """``hpsearch_heatmaps.png``: one batch x learning-rate grid of areas per worker count
    (Figs. 5.5-5.8), on one colour scale."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    cfg = doc["config"]
    key, unit = _area_key(cfg)
    workers = list(cfg["workers"])
    kept_areas = [r[key] for r in doc["runs"] if r["status"] == "kept"]
    vmin, vmax = (min(kept_areas), max(kept_areas)) if kept_areas else (0.0, 1.0)

    fig, axes = plt.subplots(1, len(workers), figsize=(4.2 * len(workers) + 1, 0.5 * len(cfg["batch_sizes"]) + 2.6),
                             squeeze=False, layout="constrained")
    norm = LogNorm(vmin, vmax) if 0 < vmin < vmax else None
    image = None
    by_point = _by_point(doc)
    for ax, n in zip(axes[0], workers, strict=True):
        image = _heatmap(ax, n, doc, by_point, norm, (vmin, vmax))
    fig.colorbar(image, ax=axes[0].tolist(), label=f"area under the loss curve ({unit})")
    fig.suptitle(f"digits, {cfg['model']}, ps_grad, {cfg['samples']} samples seen per run "
                 f"(red: best; grey: min loss > {cfg['threshold']:g}; hatched: diverged)", fontsize=9)
    fig.savefig(out / "hpsearch_heatmaps.png", dpi=110)
    plt.close(fig)


def _heatmap(ax, n: int, doc: dict[str, Any], by_point: dict[tuple[int, int, float], dict[str, Any]], norm,
             limits: tuple[float, float]):
    """Worker count ``n``'s grid on ``ax``: the kept runs' areas coloured, the others
    marked; the winner framed in red. Returns the image (for the colour bar)."""
    import matplotlib.pyplot as plt

    cfg = doc["config"]
    key, _ = _area_key(cfg)
    batches, lrs = list(cfg["batch_sizes"]), [float(v) for v in cfg["lrs"]]
    vmin, vmax = limits
    grid = np.full((len(batches), len(lrs)), np.nan)
    for i, b in enumerate(batches):
        for j, lr in enumerate(lrs):
            r = by_point.get((n, b, lr))
            if r is not None and r["status"] == "kept":
                grid[i, j] = r[key]
    cmap = plt.get_cmap("viridis_r").with_extremes(bad="white")
    image = ax.imshow(grid, cmap=cmap, norm=norm, vmin=None if norm else vmin, vmax=None if norm else vmax,
                      aspect="auto")
    for i, b in enumerate(batches):
        for j, lr in enumerate(lrs):
            _heatmap_cell(ax, i, j, by_point.get((n, b, lr)), key, cfg["threshold"])
    ax.set_xticks(range(len(lrs)), [f"{v:g}" for v in lrs])
    ax.set_yticks(range(len(batches)), [str(b) for b in batches])
    ax.set_xlabel("learning rate")
    if n == cfg["workers"][0]:
        ax.set_ylabel("batch size per worker")
    best = doc["best"].get(str(n))
    ax.set_title(f"{n} worker(s): best batch {best['batch']}, lr {best['lr']:g}" if best
                 else f"{n} worker(s): no run reached loss <= {cfg['threshold']:g}", fontsize=9)
    return image


def _heatmap_cell(ax, i: int, j: int, r: dict[str, Any] | None, key: str, threshold: float) -> None:
    """Cell (i, j): the area, or n/a, diverged (hatched) or above the threshold (grey)."""
    from matplotlib.patches import Rectangle

    if r is None:
        text, face = "n/a", "white"
    elif r["status"] == "diverged":
        text, face = "diverged", "0.25"
    elif r["status"] == "above threshold":
        text, face = f"> {threshold:g}\n({r['min_loss']:.2f})", "0.8"
    else:
        text, face = f"{r[key]:.3g}", None
    if face is not None:
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=face, edgecolor="0.5",
                               hatch="//" if r is not None and r["status"] == "diverged" else None))
    color = "white" if face == "0.25" else "black"
    ax.text(j, i, text, ha="center", va="center", fontsize=7, color=color)
    if r is not None and r.get("best"):
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", lw=2.5))


def _plot_areas(doc: dict[str, Any], out: Path) -> None:
    """``hpsearch_areas.png``: per worker count, the runs' areas sorted by minimum loss
    (Figs. 5.1-5.4)."""
    import matplotlib.pyplot as plt

    key, unit = _area_key(doc["config"])
    workers = list(doc["config"]["workers"])
    fig, axes = plt.subplots(len(workers), 1, figsize=(9, 2.4 * len(workers)), squeeze=False)
    for ax, n in zip(axes[:, 0], workers, strict=True):
        rows = [r for r in doc["runs"] if r["workers"] == n and r["status"] != "diverged"]
        rows.sort(key=lambda r: r["min_loss"])
        colors = ["red" if r.get("best") else ("tab:blue" if r["status"] == "kept" else "0.7") for r in rows]
        ax.bar(range(len(rows)), [r[key] for r in rows], color=colors)
        ax.set_xticks(range(len(rows)), [f"b{r['batch']}\nlr{r['lr']:g}" for r in rows], fontsize=6)
        diverged = sum(r["workers"] == n and r["status"] == "diverged" for r in doc["runs"])
        ax.set_title(f"{n} worker(s): area, runs sorted by minimum loss (grey: above threshold; "
                     f"{diverged} diverged, not shown)", fontsize=8)
        ax.set_ylabel(unit, fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "hpsearch_areas.png", dpi=110)
    plt.close(fig)


def _plot_best_losses(doc: dict[str, Any], out: Path) -> None:
    """``hpsearch_best_losses.png``: the winners' loss curves against wall time (cf. Fig. 6.2)."""
    import matplotlib.pyplot as plt

    by_point = _by_point(doc)
    fig, ax = plt.subplots(figsize=(7, 4))
    for n, b in doc["best"].items():
        r = by_point[(int(n), b["batch"], b["lr"])]
        ax.plot(r["time"], r["loss"], lw=0.8, label=f"{n} worker(s), batch {b['batch']}, lr {b['lr']:g}")
    ax.axhline(doc["config"]["threshold"], color="0.5", ls="--", lw=0.8, label="threshold")
    ax.set_xlabel("wall time of the run (s)")
    ax.set_ylabel("training loss (union batch)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("the winners' loss curves (cf. Fig. 6.2)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "hpsearch_best_losses.png", dpi=110)
    plt.close(fig)


def _list(kind):
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {kind.__name__}s") from None
    return parse


def add_experiment_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Add ``hpsearch`` to the subcommands of ``shmtrain experiment``."""
    d = SearchConfig()
    p = subparsers.add_parser(
        "hpsearch", help="batch size x learning rate search at constant samples seen (SHM-Learn-Dist Sec. 5)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--out", required=True, type=Path, help="folder for hpsearch.json and the PNG plots")
    p.add_argument("--workers", type=_list(int), nargs="+",
                   help=f"worker counts, e.g. 1,2,4 or 1 2 4 (default {','.join(map(str, d.workers))})")
    p.add_argument(
        "--batch-sizes", type=_list(int), nargs="+", help=f"per worker (default {','.join(map(str, d.batch_sizes))})"
    )
    p.add_argument("--lrs", type=_list(float), nargs="+", help=f"learning rates (default {','.join(map(str, d.lrs))})")
    p.add_argument("--samples", type=int, help=f"training samples seen per run (default {d.samples})")
    p.add_argument("--threshold", type=float, help=f"keep runs whose minimum loss is <= this (default {d.threshold})")
    p.add_argument("--model", help=f"a registry model (default {d.model}; folded_mlp uses FoldedLinear)")
    p.add_argument("--area-over", choices=AREA_OVER, help="x axis of the area: wall time (the paper's) or samples seen")
    p.add_argument("--seed", type=int, help=f"seed of the weights and the sampling, one for every point "
                                            f"(default {d.seed})")
    p.add_argument(
        "--full",
        action="store_true",
        help="the paper's grid: workers 1,2,4,8; batch 16-512; lr 0.1-0.9; 307,200 samples (hours here)",
    )
    p.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    values = dict(PAPER_GRID) if args.full else {}
    for name in ("workers", "batch_sizes", "lrs", "samples", "threshold", "model", "area_over", "seed"):
        value = getattr(args, name)
        if value is not None:
            # list options take "1,2,4" or "1 2 4"
            values[name] = tuple(v for part in value for v in part) if isinstance(value, list) else value
    run_hpsearch(args.out, SearchConfig(**values))
    return 0
