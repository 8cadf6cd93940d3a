"""``shmtrain bench ps``: parameter-server phase times against the number of workers
(PS-TIMING; SHM-Learn-Dist Figs. 6.4-6.6).

For each worker count one launch runs every (strategy, transport) pair in turn on a
model that is one parameter vector of ``--size`` bytes (its gradient is a fixed random
vector, so compute is negligible and the round is all communication). Reported per
iteration, median over the timed iterations, in milliseconds:

* ``gather``: the server (rank 0) waiting for / receiving every worker's buffer
  (Fig. 6.5); with ``shm`` there is no copy, so this is the wait for the slowest worker;
* ``average``: the server averaging the buffers (Fig. 6.4; grows with the worker count);
* ``broadcast``: the server publishing the new weights (Fig. 6.6); ``bcast_wait`` is
  the other workers' median wait for them (with ``shm``: the server's average and
  update, plus the wake-up; with ``ps_weight``: plus the copy into their own slot);
* ``iteration``: rank 0's time per iteration.

``gloo`` is the Caffe-MPI star (torch.distributed gather/broadcast, ShmCaffe Section
IV-C); ``shm`` is shmtrain's zero-copy shared-memory exchange. With more workers than
cores, workers time-share the cores and each wait includes the others' turns.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shmtrain.bench.common import parse_size, table, write_json

STRATEGIES = ("ps_grad", "ps_weight")
TRANSPORTS = ("shm", "gloo")
COLUMNS = [
    ("strategy", "strategy", ""), ("transport", "transport", ""), ("workers", "workers", "d"),
    ("gather_ms", "gather ms", ".3f"), ("average_ms", "average ms", ".3f"),
    ("broadcast_ms", "bcast ms", ".3f"), ("bcast_wait_ms", "bcast_wait ms", ".3f"),
    ("comm_ms", "comm ms", ".3f"), ("iteration_ms", "iter ms", ".3f"),
]


class VectorModel(nn.Module):
    """One parameter vector; ``forward(x) = <w, x>``, so the gradient is ``x``."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.dot(self.weight, x)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def bench_worker(ctx, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Every (strategy, transport) pair in turn; this rank's per-phase medians."""
    from shmtrain.parallel.data_parallel import DataParallel

    numel = payload["numel"]
    x = torch.randn(numel, generator=torch.Generator().manual_seed(ctx.rank)) * 1e-3
    out = []
    for strategy, transport in payload["pairs"]:
        model = VectorModel(numel)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        dp = DataParallel(model, opt, strategy, ctx=ctx, ps_transport=transport)
        samples: dict[str, list[float]] = {}
        for it in range(payload["warmup"] + payload["iterations"]):
            start = time.perf_counter()
            dp.zero_grad()
            dp(x).backward()
            dp.step()
            phases = dp.timer.finish_iteration()
            phases["iteration"] = time.perf_counter() - start
            if it >= payload["warmup"]:
                for name in ("gather", "average", "broadcast", "comm", "iteration"):
                    samples.setdefault(name, []).append(phases.get(name, 0.0))
        dp.close()
        out.append({"strategy": strategy, "transport": transport,
                    **{name: _median(v) for name, v in samples.items()}})
    return out


def run(workers: list[int], strategies: list[str], transports: list[str], numel: int,
        iterations: int, warmup: int, log=print) -> list[dict[str, Any]]:
    from shmtrain.runtime.launch.launcher import launch

    pairs = [(s, t) for s in strategies for t in transports]
    rows = []
    for n in workers:
        t0 = time.perf_counter()
        results = launch("shmtrain.bench.ps:bench_worker", n,
                         {"pairs": pairs, "numel": numel, "iterations": iterations, "warmup": warmup},
                         timeout=600)
        for k, (strategy, transport) in enumerate(pairs):
            server = results[0][k]
            others = [r[k]["broadcast"] for r in results[1:]]
            rows.append({
                "strategy": strategy, "transport": transport, "workers": n, "bytes": numel * 4,
                "gather_ms": 1e3 * server["gather"], "average_ms": 1e3 * server["average"],
                "broadcast_ms": 1e3 * server["broadcast"],
                "bcast_wait_ms": 1e3 * _median(others) if others else None,
                "comm_ms": 1e3 * server["comm"], "iteration_ms": 1e3 * server["iteration"],
            })
        log(f"bench ps: {n} workers done in {time.perf_counter() - t0:.1f} s")
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Figs. 6.4-6.6: average, gather and broadcast time against the number of workers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("average_ms", "averaging at the server (Fig. 6.4)"),
              ("gather_ms", "gathering at the server (Fig. 6.5)"),
              ("broadcast_ms", "broadcast from the server (Fig. 6.6)"),
              ("bcast_wait_ms", "workers' wait for the weights")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    series = sorted({(r["strategy"], r["transport"]) for r in rows})
    for ax, (key, title) in zip(axes, panels, strict=True):
        for strategy, transport in series:
            pts = sorted((r["workers"], r[key]) for r in rows
                         if (r["strategy"], r["transport"]) == (strategy, transport) and r[key] is not None)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=f"{strategy} / {transport}")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("workers")
        ax.set_ylabel("ms per iteration (median)")
        ax.set_xticks(sorted({r["workers"] for r in rows}))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    size = rows[0]["bytes"] / 2**20 if rows else 0
    fig.suptitle(f"parameter-server phases, {size:g} MiB of float32 parameters", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _handler(args: argparse.Namespace) -> int:
    if any(n < 1 for n in args.workers):
        raise ValueError(f"--workers {' '.join(map(str, args.workers))}: worker counts must be >= 1")
    if args.iterations < 1 or args.warmup < 0:
        raise ValueError("--iterations must be >= 1 and --warmup >= 0")
    numel = parse_size(args.size) // 4
    if numel < 1:
        raise ValueError(f"--size {args.size!r} holds no float32 element")
    rows = run(args.workers, args.strategies, args.transports, numel, args.iterations, args.warmup)
    print(table(rows, COLUMNS))
    if args.json:
        write_json(args.json, rows)
        png = Path(args.png) if args.png else Path(args.json).with_suffix(".png")
        plot(rows, png)
        print(f"wrote {args.json} and {png}")
    elif args.png:
        plot(rows, Path(args.png))
        print(f"wrote {args.png}")
    return 0


def add_bench_ps_parser(bench: argparse._SubParsersAction) -> None:
    """Add ``ps`` to the subcommands of ``shmtrain bench``."""
    p = bench.add_parser("ps", help="parameter server: gather / average / broadcast time vs workers (Figs. 6.4-6.6)",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8], help="worker counts (default 2 4 8)")
    p.add_argument("--size", default="4MiB", help="parameter bytes (float32; default 4MiB)")
    p.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=["ps_grad"],
                   help="default ps_grad (the paper's gradient-averaging server)")
    p.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS),
                   help="default: shm gloo")
    p.add_argument("--iterations", type=int, default=20, help="timed iterations (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations first (default 3)")
    p.add_argument("--json", help="write the rows here (and the plot next to it, .png)")
    p.add_argument("--png", help="write the plot here")
    p.set_defaults(handler=_handler)
