"""``shmtrain bench step``: time per training iteration, strategies side by side with DDP.

Same model, same synthetic batch, same threads for every mode: ``nocomm`` (each worker
trains alone; the floor), ``ddp`` (torch DistributedDataParallel over gloo), ``ddp-backend`` (DDP on the ``shm``
backend), ``ddp-shm``
(DDP with ``shmtrain.ddp_comm_hook``: its buckets averaged through shared memory), and the
shmtrain strategies in :data:`MODES`. Each mode is one launch of N workers; a sample is
one iteration's wall time on a worker, and the row reports the median over workers
and iterations after warm-up, plus the mean of each phase the strategy reports.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from torch import nn

from shmtrain.bench.common import DDP_MODES, bench_device, table, write_json
from shmtrain.fabric.job.context import ProcessContext
from shmtrain.runtime.launch.launcher import launch

#: mode -> (strategy, options); ``ddp`` and ``ddp-shm`` (:data:`DDP_MODES`) are handled apart.
MODES: dict[str, tuple[str, dict[str, Any]]] = {
    "nocomm": ("nocomm", {}),
    "ssgd": ("ssgd", {}),
    # communication overlapped with backward (docs/overlap.md)
    "gpi": ("gpi", {}),
    "cpu_acc": ("cpu_acc", {}),
    "ssgd_overlap": ("ssgd", {"overlap": True}),
    # the update sharded over the host's workers, ZeRO-1 inside a host
    "ssgd_sharded": ("ssgd", {"sharded_update": True}),
    # GPUs, one per worker: NCCL's allreduce, the DDP baseline
    "ssgd_nccl": ("ssgd", {"allreduce": "nccl"}),
}
DEFAULT_MODES = ["nocomm", "ddp", "ssgd"]


def _worker(ctx: ProcessContext, payload: dict[str, Any]) -> dict[str, Any]:
    from shmtrain.bench.common import build_engine, synthetic_setup, worker_setup
    from shmtrain.runtime.train.trainer import Trainer
    from shmtrain.timing import PhaseTimer

    device, sync = worker_setup(payload.get("device", "cpu"), ctx.local_rank)
    model, x, y, optimizer = synthetic_setup(payload["model"], payload["input_shape"],
                                             payload["batch_size"], ctx.rank)
    model, x, y = model.to(device), x.to(device), y.to(device)
    loss_fn = nn.CrossEntropyLoss()
    mode = payload["mode"]
    timer = PhaseTimer(device)
    strategy, options = MODES.get(mode, (None, None))
    engine = build_engine(mode, ctx, model, optimizer, timer, strategy, options)
    trainer = Trainer(engine, loss_fn, timer)

    def step() -> None:
        trainer.step(x, y)

    samples, phases = [], []
    for i in range(payload["warmup"] + payload["iterations"]):
        start = time.perf_counter()
        step()
        sync()  # a GPU's queued work is part of the iteration
        elapsed = time.perf_counter() - start
        record = timer.finish_iteration()
        if i >= payload["warmup"]:
            samples.append(elapsed)
            phases.append(record)
    engine.close()
    names = {k for p in phases for k in p}
    return {"samples": samples, "phases": {k: statistics.fmean(p.get(k, 0.0) for p in phases) for k in names},
            "remaining": (statistics.median(p["collect_remaining"] for p in phases)
                          if "collect_remaining" in names else None)}


def run(modes: list[str], workers: list[int], payload: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for n in workers:
        for mode in modes:
            print(f"... {mode}, {n} worker(s)", flush=True)
            results = launch("shmtrain.bench.step:_worker", n, dict(payload, mode=mode), threads=payload["threads"])
            samples = [s for r in results for s in r["samples"]]
            phase_names = {k for r in results for k in r["phases"]}
            rows.append({
                "mode": mode, "workers": n, "model": payload["model"], "batch_size": payload["batch_size"],
                "device": payload.get("device", "cpu"),
                "threads": payload["threads"], "median_s": statistics.median(samples), "min_s": min(samples),
                "samples": len(samples),
                "phases_s": {k: statistics.fmean(r["phases"].get(k,
                                                                 0.0) for r in results) for k in sorted(phase_names)},
                # median per worker: one stalled iteration must not stand for the typical one
                "collect_remaining_s": statistics.fmean(r["remaining"] for r in results)
                if results[0].get("remaining") is not None else None,
            })
    for row in rows:
        base = next((r for r in rows if r["mode"] == "nocomm" and r["workers"] == row["workers"]), None)
        row["vs_nocomm"] = row["median_s"] / base["median_s"] if base else None
        remaining = row["collect_remaining_s"]
        row["collect_remaining_share"] = remaining / row["median_s"] if remaining is not None else None
    return rows


def check_modes(modes: list[str]) -> None:
    """Reject a ``--modes`` name that is neither in :data:`DDP_MODES` nor in :data:`MODES`."""
    unknown = [m for m in modes if m not in DDP_MODES and m not in MODES]
    if unknown:
        raise ValueError(f"--modes {unknown}: unknown; choose from {', '.join([*DDP_MODES, *MODES])}")


def _handler(args: argparse.Namespace) -> int:
    device, modes = bench_device(args.device, DEFAULT_MODES, ["nocomm", "ssgd"], args.modes)
    check_modes(modes)
    if any(w < 1 for w in args.workers):
        raise ValueError(f"--workers {args.workers}: every worker count must be at least 1")
    if args.iterations < 1 or args.warmup < 0 or args.batch_size < 1 or args.threads < 1:
        raise ValueError("--iterations, --batch-size and --threads must be at least 1 and --warmup not negative")
    payload = {"model": args.model, "input_shape": args.input_shape, "batch_size": args.batch_size,
               "iterations": args.iterations, "warmup": args.warmup, "threads": args.threads, "device": device}
    rows = run(modes, args.workers, payload)
    print(table(rows, [("workers", "workers", "d"), ("mode", "mode", "s"), ("median_s", "median s", ".4f"),
                       ("min_s", "min s", ".4f"), ("vs_nocomm", "vs nocomm", ".3f"),
                       ("collect_remaining_share", "remaining", ".2%")]))
    write_json(args.json, rows)
    return 0


def add_parser(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("step", help="time per iteration: strategies vs DDP vs no communication",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18", help="model name (default resnet18)")
    p.add_argument("--input-shape", default="3x64x64", help="CxHxW of the synthetic batch (default 3x64x64)")
    p.add_argument("--batch-size", type=int, default=32, help="per worker (default 32)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts (default 1 2)")
    p.add_argument("--modes", nargs="+", help=f"default: {' '.join(DEFAULT_MODES)}")
    p.add_argument("--iterations", type=int, default=10, help="timed iterations (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations first (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda (worker r on GPU r mod the count), "
                   "cuda:N (every worker on GPU N) or auto; on a GPU the default modes are nocomm ssgd")
    p.add_argument("--json", help="write the rows here")
    p.set_defaults(handler=_handler)
