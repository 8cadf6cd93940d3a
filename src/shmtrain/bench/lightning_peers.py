"""``shmtrain bench lightning``: Lightning's Trainer, the same model and data, on three
peers: ``DDPStrategy`` on gloo, ``DDPStrategy`` on the ``shm`` backend, and
``ShmtrainStrategy("ssgd")``.

Each round runs one fit per peer (torchrun, ``--workers`` processes,
:mod:`shmtrain.bench.lightning_fit`), the peers' order rotated each round so none always
runs first on a machine whose load drifts; a fit's figure is rank 0's seconds per step
after ``--warmup`` steps (start-up excluded). The table gives each peer's median over the
rounds. Every peer is validated in every round: its final weights must equal the gloo
DDP run's of the same round to a relative 1e-5 (all three are synchronous SGD on the same
batches), or the command fails naming it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from shmtrain.bench.common import table, write_json

PEERS = ("ddp-gloo", "ddp-shm", "shmtrain")


def fit(peer: str, out: Path, args: argparse.Namespace, port: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.workers),
               "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "shmtrain.bench.lightning_fit",
               peer, str(out), str(args.width), str(args.depth), str(args.batch_size), str(args.steps),
               str(args.warmup)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the {peer} fit failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return torch.load(out, weights_only=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    times: dict[str, list[float]] = {peer: [] for peer in PEERS}
    numel = 0
    with tempfile.TemporaryDirectory(prefix="shmtrain-bench-lightning-") as folder:
        for round_ in range(args.rounds):
            order = PEERS[round_ % len(PEERS):] + PEERS[:round_ % len(PEERS)]
            results = {peer: fit(peer, Path(folder) / f"{peer}-{round_}.pt", args, _free_port()) for peer in order}
            reference = results["ddp-gloo"]["params"]
            for peer, result in results.items():
                error = float((result["params"] - reference).norm() / reference.norm())
                if error > 1e-5:
                    raise RuntimeError(f"{peer}'s weights differ from DDP on gloo's by {error:.2e} in round "
                                       f"{round_}: the peers did not train the same model")
                times[peer].append(result["step_s"])
            numel = int(results["ddp-gloo"]["numel"])
    base = statistics.median(times["ddp-gloo"])
    when = {"utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
            "load_1min": round(os.getloadavg()[0], 2), "workers": args.workers, "width": args.width,
            "depth": args.depth, "batch_size": args.batch_size, "timed_steps": args.steps - args.warmup}
    return [{**when, "peer": peer, "params_m": numel / 1e6, "median_ms": 1e3 * statistics.median(samples),
             "min_ms": 1e3 * min(samples), "max_ms": 1e3 * max(samples), "speedup": base / statistics.median(samples),
             "rounds": len(samples), "samples_ms": [1e3 * s for s in samples]}
            for peer, samples in times.items()]


def _handler(args: argparse.Namespace) -> int:
    for name in ("workers", "width", "depth", "batch_size", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1; "
                             "use e.g. --workers 2 --width 1024 --depth 4 --batch-size 32 --rounds 3")
    if args.steps <= args.warmup or args.warmup < 0:
        raise ValueError(f"--steps {args.steps} --warmup {args.warmup}: the timed steps are steps - warmup, which "
                         "must be at least 1, and --warmup not negative; use e.g. --steps 40 --warmup 10")
    rows = run(args)
    print(table(rows, [("peer", "peer", "s"), ("params_m", "params M", ".2f"), ("median_ms", "ms/step", ".2f"),
                       ("min_ms", "min", ".2f"), ("max_ms", "max", ".2f"), ("speedup", "vs gloo", ".2f"),
                       ("rounds", "rounds", "d")]))
    print(f"({args.workers} workers, MLP {args.depth} x {args.width}, batch {args.batch_size} per worker, "
          f"{args.steps - args.warmup} timed steps after {args.warmup}; median of {args.rounds} interleaved rounds; "
          "every peer's weights equal DDP on gloo's)")
    write_json(args.json, rows)
    return 0


def add_bench_lightning_parser(bench: argparse._SubParsersAction) -> None:
    """Register ``shmtrain bench lightning``."""
    p = bench.add_parser("lightning", help="Lightning's Trainer: DDPStrategy on gloo vs on shm vs ShmtrainStrategy",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="processes (default 2)")
    p.add_argument("--width", type=int, default=1024, help="the MLP's hidden width (default 1024)")
    p.add_argument("--depth", type=int, default=4, help="its hidden layers (default 4)")
    p.add_argument("--batch-size", type=int, default=32, help="per worker (default 32)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per fit (default 40)")
    p.add_argument("--warmup", type=int, default=10, help="of them untimed first (default 10)")
    p.add_argument("--rounds", type=int, default=3, help="fits per peer, interleaved (default 3)")
    p.add_argument("--json", help="write the rows here")
    p.set_defaults(handler=_handler)
