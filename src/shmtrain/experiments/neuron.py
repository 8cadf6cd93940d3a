"""NEURON: one sigmoid neuron learns the step function of eq. 3.1, data-parallel over
2, 4, 8 and 16 workers, with gradient averaging (eq. 2.1) and weight averaging (eq. 2.2).

SHM-Learn-Dist Section 3 (Fig. 2.1): ``f(x) = 0 if x < 0.5 else 1``; one neuron
``sigmoid(w x + b)``; plain SGD, learning rate 0.5, no regularisation; 10,000 steps per
worker. Every worker draws its own samples ``x ~ U(0, 1)`` (``batch_size`` per step,
1 by default); the loss is the L2 (mean squared) error of the sigmoid output. The
curves are the training loss of each step averaged over the workers (the loss of the
union batch, which is what every worker's update sees) and the loss of the server's
weights on a fixed grid of 101 points in [0, 1].

Two engines, one set of equations:

* ``in-process`` (default): the workers' update equations in one process, vectorised
  over the workers, with the strategies' own server arithmetic
  (:func:`shmtrain.fabric.exchanges.star.average_`) and the worker processes' own data
  streams. Measured here (2 shared cores), real worker processes need ~21 s per 1,000
  steps at 16 workers and ~6 s at 2, so 16 x 10,000 steps alone would take ~3.5 minutes
  per averaging mode. Every run therefore also starts the real strategies in
  ``check_workers`` processes for ``check_steps`` steps and records how far their
  losses are from the in-process engine's (``cross_check`` in the JSON).
* ``processes``: the real strategies (``ps_grad``, ``ps_weight``) in real worker
  processes started by :func:`shmtrain.runtime.launch.launcher.launch`, one launch per worker
  count running both averaging modes.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

WORKERS = (2, 4, 8, 16)
MODES = ("grad", "weight")
STRATEGY = {"grad": "ps_grad", "weight": "ps_weight"}
ENGINES = ("in-process", "processes")


def step_function(x: torch.Tensor) -> torch.Tensor:
    """Eq. 3.1: 0 below 0.5, 1 from 0.5 on."""
    return (x >= 0.5).to(x.dtype)


@dataclass
class NeuronConfig:
    """Options of ``shmtrain experiment neuron`` (defaults: the paper's)."""

    workers: tuple[int, ...] = WORKERS
    steps: int = 10_000
    lr: float = 0.5
    batch_size: int = 1
    average_interval: int = 1
    seed: int = 0
    eval_every: int = 50
    engine: str = "in-process"
    check_workers: int = 2
    check_steps: int = 200
    modes: tuple[str, ...] = field(default=MODES)

    def __post_init__(self) -> None:
        if not self.workers or any(not isinstance(n, int) or n < 1 for n in self.workers):
            raise ValueError(f"--workers {self.workers!r}: every worker count must be an integer >= 1, e.g. 2,4,8,16")
        for name in ("steps", "batch_size", "average_interval", "eval_every", "check_workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} {value!r} must be an integer >= 1")
        if not isinstance(self.check_steps, int) or self.check_steps < 0:
            raise ValueError(f"--check-steps {self.check_steps!r} must be an integer >= 0 (0: no check)")
        if not (self.lr > 0 and np.isfinite(self.lr)):
            raise ValueError(f"--lr {self.lr!r} must be a positive number (the paper uses 0.5)")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine {self.engine!r}: choose one of {', '.join(ENGINES)}")
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ValueError(f"--modes {self.modes!r}: choose from {', '.join(MODES)}")


def samples(seed: int, rank: int, steps: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``rank``'s inputs and targets for every step: ``(steps, batch, 1)`` each."""
    gen = torch.Generator().manual_seed(seed * 100_003 + rank + 1)
    x = torch.rand(steps, batch, 1, generator=gen)
    return x, step_function(x)


def _grid() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.linspace(0, 1, 101).unsqueeze(1)
    return x, step_function(x)


def initial_neuron(seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(1, 1)


def neuron_worker(ctx, cfg: dict[str, Any]) -> dict[str, Any]:
    """One worker process: train the neuron with each averaging mode in turn."""
    from shmtrain.parallel.data_parallel import DataParallel

    steps, batch = cfg["steps"], cfg["batch_size"]
    x, y = samples(cfg["seed"], ctx.rank, steps, batch)
    gx, gy = _grid()
    out: dict[str, Any] = {}
    for mode in cfg["modes"]:
        neuron = initial_neuron(cfg["seed"])
        opt = torch.optim.SGD(neuron.parameters(), lr=cfg["lr"])
        options = {"average_interval": cfg["average_interval"]} if mode == "weight" else {}
        dp = DataParallel(neuron, opt, STRATEGY[mode], ctx=ctx, **options)
        losses = np.empty(steps, dtype=np.float64)
        evals = []
        start = time.perf_counter()
        for t in range(steps):
            dp.zero_grad()
            loss = nn.functional.mse_loss(torch.sigmoid(dp(x[t])), y[t])
            loss.backward()
            dp.step()
            dp.timer.finish_iteration()
            losses[t] = loss.item()
            if ctx.rank == 0 and (t + 1) % cfg["eval_every"] == 0:
                with torch.no_grad():
                    evals.append(float(nn.functional.mse_loss(torch.sigmoid(neuron(gx)), gy)))
        seconds = time.perf_counter() - start
        dp.close()
        out[mode] = {"loss": losses, "eval": evals, "seconds": seconds,
                     "weights": [neuron.weight.item(), neuron.bias.item()]}
    return out


def simulate(cfg: NeuronConfig, workers: int, mode: str, steps: int | None = None) -> dict[str, Any]:
    """The ``workers`` workers' update equations in one process, vectorised over workers.

    Eq. 2.1 (``grad``): every worker's gradient at the shared weights; the server's mean
    of them (:func:`average_`, the strategies' own arithmetic) is applied once. Eq. 2.2
    (``weight``): every worker applies its own gradient to its own weights; every
    ``average_interval`` steps the weights are averaged (:func:`average_`). The gradient
    of the L2 loss of ``sigmoid(w x + b)`` is written out (autograd per worker and step
    would cost ~15 s per run here); the data streams are the worker processes' own.
    """
    from shmtrain.fabric.exchanges.star import average_

    steps = cfg.steps if steps is None else steps
    data = [samples(cfg.seed, r, steps, cfg.batch_size) for r in range(workers)]
    x = torch.stack([d[0][..., 0] for d in data], dim=1)  # (steps, workers, batch)
    y = torch.stack([d[1][..., 0] for d in data], dim=1)
    start_neuron = initial_neuron(cfg.seed)
    w0 = torch.tensor([start_neuron.weight.item(), start_neuron.bias.item()], dtype=torch.float32)
    weights = w0.repeat(workers, 1)  # (workers, 2): [w, b] of every worker, float32 like the model
    gx, gy = _grid()
    losses = np.empty(steps, dtype=np.float64)
    evals = []
    mean = torch.empty(2)
    start = time.perf_counter()
    for t in range(steps):
        w, b = weights[:, 0:1], weights[:, 1:2]
        out = torch.sigmoid(w * x[t] + b)
        err = out - y[t]
        dz = 2.0 * err * out * (1.0 - out) / cfg.batch_size  # d(mean squared error)/d(w x + b)
        grads = torch.stack([(dz * x[t]).sum(1), dz.sum(1)], dim=1)  # (workers, 2)
        if mode == "grad":
            average_(mean, list(grads))
            weights = (weights[0] - cfg.lr * mean).repeat(workers, 1)
        else:
            weights = weights - cfg.lr * grads
            if (t + 1) % cfg.average_interval == 0:
                weights = average_(mean, list(weights)).repeat(workers, 1)
        losses[t] = float((err * err).mean())
        if (t + 1) % cfg.eval_every == 0:
            evals.append(float(((torch.sigmoid(weights[0, 0] * gx + weights[0, 1]) - gy) ** 2).mean()))
    return {"loss": losses, "eval": evals, "seconds": time.perf_counter() - start,
            "weights": [float(v) for v in weights[0]]}


def cross_check(cfg: NeuronConfig) -> dict[str, Any]:
    """Run the real strategies in ``check_workers`` processes for ``check_steps`` steps and
    compare their per-step loss with the in-process engine's (the two must agree)."""
    from shmtrain.runtime.launch.launcher import launch

    short = NeuronConfig(**{**asdict(cfg), "steps": cfg.check_steps, "workers": (cfg.check_workers,)})
    start = time.perf_counter()
    results = launch("shmtrain.experiments.neuron:neuron_worker", cfg.check_workers, asdict(short), timeout=600)
    report: dict[str, Any] = {"workers": cfg.check_workers, "steps": cfg.check_steps}
    for mode in cfg.modes:
        real = np.mean([r[mode]["loss"] for r in results], axis=0)
        sim = simulate(short, cfg.check_workers, mode)
        report[mode] = {
            "max_abs_loss_difference": float(np.max(np.abs(real - sim["loss"]))),
            "final_weights_processes": results[0][mode]["weights"],
            "final_weights_in_process": sim["weights"],
        }
    report["seconds"] = time.perf_counter() - start
    return report


def run_neuron(out: Path, cfg: NeuronConfig | None = None, *, log=print) -> dict[str, Any]:
    """Run the NEURON experiment; write ``neuron.json`` and ``neuron_loss.png`` /
    ``neuron_eval.png`` into ``out``; return the JSON document."""
    from shmtrain.runtime.launch.launcher import launch

    cfg = cfg or NeuronConfig()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    payload = asdict(cfg)
    runs: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    for n in cfg.workers:
        engine = cfg.engine
        t0 = time.perf_counter()
        if engine == "processes":
            results = launch("shmtrain.experiments.neuron:neuron_worker", n, payload, timeout=600)
            for mode in cfg.modes:
                loss = np.mean([r[mode]["loss"] for r in results], axis=0)
                runs[f"{mode}/{n}"] = {
                    "mode": mode, "workers": n, "engine": engine, "loss": loss.tolist(),
                    "eval": results[0][mode]["eval"], "seconds": results[0][mode]["seconds"],
                    "final_weights": results[0][mode]["weights"],
                }
        else:
            for mode in cfg.modes:
                result = simulate(cfg, n, mode)
                runs[f"{mode}/{n}"] = {
                    "mode": mode, "workers": n, "engine": engine, "loss": result["loss"].tolist(),
                    "eval": result["eval"], "seconds": result["seconds"], "final_weights": result["weights"],
                }
        log(f"neuron: {n:3d} workers ({engine}) done in {time.perf_counter() - t0:.1f} s")
    check = None
    if cfg.engine == "in-process" and cfg.check_steps:
        check = cross_check(cfg)
        diffs = ", ".join(f"{m} {check[m]['max_abs_loss_difference']:.2e}" for m in cfg.modes)
        log(f"neuron: cross-check, real ps_grad/ps_weight in {cfg.check_workers} processes vs in-process, "
            f"{cfg.check_steps} steps: max |loss difference| {diffs} ({check['seconds']:.1f} s)")
    doc = {"config": payload, "runs": runs, "summary": summarize(runs, cfg), "cross_check": check,
           "total_seconds": time.perf_counter() - started}
    (out / "neuron.json").write_text(json.dumps(doc) + "\n")
    plot(doc, out)
    log(table(doc["summary"]))
    log(f"wrote {out / 'neuron.json'}, {out / 'neuron_loss.png'}, {out / 'neuron_eval.png'}")
    return doc


def summarize(runs: dict[str, dict[str, Any]], cfg: NeuronConfig) -> list[dict[str, Any]]:
    """Per run: final losses, noise (std of the training loss over the last 20% of steps)."""
    rows = []
    tail = max(1, cfg.steps // 5)
    for key, run in runs.items():
        loss = np.asarray(run["loss"])
        evals = run["eval"]
        rows.append({
            "run": key, "mode": run["mode"], "workers": run["workers"], "engine": run["engine"],
            "final_train_loss": float(loss[-tail:].mean()), "train_loss_std": float(loss[-tail:].std()),
            "final_eval_loss": float(evals[-1]) if evals else None,
            "steps_to_eval_0.05": _first_below(evals, 0.05, cfg.eval_every),
            "seconds": run["seconds"],
        })
    return rows


def _first_below(evals: list[float], level: float, every: int) -> int | None:
    for i, v in enumerate(evals):
        if v <= level:
            return (i + 1) * every
    return None


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'mode':>6} {'workers':>7} {'engine':>10} {'train(last20%)':>14} {'std':>8} {'eval':>8} "
            f"{'steps->0.05':>11} {'s':>6}")
    lines = [head]
    for r in rows:
        reach = "-" if r["steps_to_eval_0.05"] is None else str(r["steps_to_eval_0.05"])
        ev = "-" if r["final_eval_loss"] is None else f"{r['final_eval_loss']:.4f}"
        lines.append(f"{r['mode']:>6} {r['workers']:>7} {r['engine']:>10} {r['final_train_loss']:>14.4f} "
                     f"{r['train_loss_std']:>8.4f} {ev:>8} {reach:>11} {r['seconds']:>6.1f}")
    return "\n".join(lines)


def plot(doc: dict[str, Any], out: Path) -> None:
    """Fig. 2.1 analogue: loss against step, one panel per averaging mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = doc["config"]
    modes = list(cfg["modes"])
    titles = {"grad": "gradient averaging (eq. 2.1)",
              "weight": f"weight averaging (eq. 2.2, interval {cfg['average_interval']})"}
    for kind, name in (("loss", "neuron_loss.png"), ("eval", "neuron_eval.png")):
        fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), sharey=True, squeeze=False)
        for ax, mode in zip(axes[0], modes, strict=True):
            for run in doc["runs"].values():
                if run["mode"] != mode:
                    continue
                values = np.asarray(run[kind])
                steps = (np.arange(len(values)) + 1) * (cfg["eval_every"] if kind == "eval" else 1)
                label = f"{run['workers']} workers"
                if kind == "eval":
                    ax.plot(steps, values, lw=1.2, alpha=0.8, label=label)
                    continue
                # raw per-step loss (its spread is the noise the paper sees fall with more
                # workers), and its moving average over 1% of the run
                line, = ax.plot(steps, values, lw=0.3, alpha=0.2)
                window = max(1, len(values) // 100)
                smooth = np.convolve(values, np.ones(window) / window, mode="valid")
                ax.plot(steps[window - 1:], smooth, lw=1.3, color=line.get_color(), label=label)
            ax.set_title(titles[mode])
            ax.set_xlabel("step (per worker)")
            if kind == "eval":
                ax.set_yscale("log")
            else:
                ax.set_ylim(0, 0.3)
            ax.grid(alpha=0.3)
            ax.legend()
        axes[0][0].set_ylabel("training loss (mean over workers)" if kind == "loss" else "L2 loss on [0, 1] grid")
        fig.suptitle(f"one sigmoid neuron learning eq. 3.1, lr {cfg['lr']}, batch {cfg['batch_size']} per worker")
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def add_experiment_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Add ``neuron`` to the subcommands of ``shmtrain experiment``."""
    p = subparsers.add_parser(
        "neuron", help="one sigmoid neuron, 2-16 workers, gradient vs weight averaging (SHM-Learn-Dist Sec. 3)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--out", required=True, type=Path, help="folder for neuron.json and the PNG plots")
    p.add_argument("--workers", type=_ints, nargs="+", default=[WORKERS],
                   help="worker counts, e.g. 2,4,8,16 or 2 4 8 16 (default 2,4,8,16)")
    p.add_argument("--steps", type=int, default=10_000, help="steps per worker (default 10000)")
    p.add_argument("--lr", type=float, default=0.5, help="learning rate (default 0.5)")
    p.add_argument("--batch-size", type=int, default=1, help="samples per worker per step (default 1)")
    p.add_argument("--average-interval", type=int, default=1, help="weight averaging every K steps (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the neuron's start and the samples (default 0)")
    p.add_argument("--engine", choices=ENGINES, default="in-process",
                   help="in-process (default): the workers' equations in one process, checked against the "
                        "real strategies; processes: real ps_grad/ps_weight worker processes (16 x 10000 "
                        "steps take far more than 5 minutes on 2 cores)")
    p.add_argument("--check-workers", type=int, default=2,
                   help="worker processes of the cross-check against the real strategies (default 2)")
    p.add_argument("--check-steps", type=int, default=200,
                   help="steps of that cross-check (default 200; 0 = skip)")
    p.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    cfg = NeuronConfig(workers=tuple(n for part in args.workers for n in part), steps=args.steps, lr=args.lr,
                       batch_size=args.batch_size,
                       average_interval=args.average_interval, seed=args.seed, engine=args.engine,
                       check_workers=args.check_workers, check_steps=args.check_steps)
    run_neuron(args.out, cfg)
    return 0
