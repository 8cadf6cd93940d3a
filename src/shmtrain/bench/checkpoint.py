"""``shmtrain bench checkpoint``: what a checkpoint costs against a training iteration.

For each model (synthetic data, SGD with momentum, ``--strategy`` over ``--workers``
processes), one launch: warm-up iterations, then timed training iterations (a sample is
one iteration's wall time on a worker), then ``--reps`` checkpoints written through the
same code as ``shmtrain train`` (:class:`shmtrain.runtime.checkpoint.checkpointer.Checkpointer`:
``Trainer.state_dict()`` snapshot, ``torch.save`` of every rank's file, fsync, rename,
the last rank completing the folder), then ``--reps`` resumes (read, CRC-32 check,
``torch.load``, ``Trainer.load_state_dict``). Before each timed checkpoint the workers
meet at a barrier; a checkpoint's time is its slowest rank's, which is what a synchronous
run waits. The launcher side of a resume, :func:`~shmtrain.runtime.checkpoint.checkpointer.validate`
(every file read and CRC-checked before any worker starts), is timed too.

The row's ``ckpt/iter`` is the save time over the median iteration time: the goal
is a ResNet-18 checkpoint below 2 iterations. The folder (``--dir``, default the system's
temporary folder) decides the disk being measured: pass the disk your runs write to.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shmtrain.bench.common import table, write_json
from shmtrain.fabric.job.context import ProcessContext
from shmtrain.runtime.launch.launcher import launch

DEFAULT_MODELS = ["smallcnn", "resnet18", "resnet50"]


def _barrier(ctx: ProcessContext) -> None:
    ctx.host.barrier("bench checkpoint")
    if ctx.num_nodes > 1:
        torch.distributed.barrier()


def _worker(ctx: ProcessContext, payload: dict[str, Any]) -> dict[str, Any]:
    from shmtrain.bench.common import synthetic_setup
    from shmtrain.parallel.data_parallel import DataParallel
    from shmtrain.runtime.checkpoint.checkpointer import Checkpointer
    from shmtrain.runtime.config import resolve
    from shmtrain.runtime.train.trainer import Trainer
    from shmtrain.timing import PhaseTimer

    model, x, y, optimizer = synthetic_setup(payload["model"], payload["input_shape"],
                                             payload["batch_size"], ctx.rank)
    timer = PhaseTimer()
    dp = DataParallel(model, optimizer, payload["strategy"], ctx=ctx, timer=timer)
    trainer = Trainer(dp, nn.CrossEntropyLoss(), timer)
    config = resolve({"device": "cpu", "strategy": payload["strategy"], "workers": ctx.world_size,
                      "model": payload["model"],
                      "data": "synthetic", "input_shape": payload["input_shape"],
                      "batch_size": payload["batch_size"], "checkpoint_every": 0, "keep_checkpoints": 1})
    out = Path(payload["dir"])
    checkpoints = Checkpointer(ctx, config, out, 1)
    iterations = []
    for i in range(payload["warmup"] + payload["iterations"]):
        start = time.perf_counter()
        trainer.step(x, y)
        timer.finish_iteration()
        if i >= payload["warmup"]:
            iterations.append(time.perf_counter() - start)
    snapshot, save, load = [], [], []
    for rep in range(payload["reps"]):
        _barrier(ctx)
        start = time.perf_counter()
        trainer.state_dict(copy=False)  # what a checkpoint takes (no snapshot copy)
        snapshot.append(time.perf_counter() - start)
        _barrier(ctx)
        start = time.perf_counter()
        checkpoints.save(trainer, 1_000_000 + rep)  # distinct steps; keep_checkpoints 1 prunes the rest
        save.append(time.perf_counter() - start)
    _barrier(ctx)  # the last rank has completed the folder
    path = out / "checkpoints" / f"step-{1_000_000 + payload['reps'] - 1}"
    for _ in range(payload["reps"]):
        _barrier(ctx)
        start = time.perf_counter()
        checkpoints.restore(trainer, str(path))
        load.append(time.perf_counter() - start)
    _barrier(ctx)
    dp.close()
    return {"iterations": iterations, "snapshot": snapshot, "save": save, "load": load,
            "params": sum(p.numel() for p in model.parameters()), "path": str(path),
            "bytes": (path / f"rank-{ctx.rank}.pt").stat().st_size}


def _slowest(results: list[dict[str, Any]], key: str) -> float:
    """Median over repetitions of the slowest rank's time."""
    return statistics.median(max(r[key][i] for r in results) for i in range(len(results[0][key])))


def run(models: list[str], payload: dict[str, Any], base: Path) -> list[dict[str, Any]]:
    from shmtrain.runtime.checkpoint.files import validate

    rows = []
    for name in models:
        print(f"... {name}, {payload['workers']} worker(s)", flush=True)
        folder = Path(tempfile.mkdtemp(prefix=f"shmtrain-bench-ckpt-{name}-", dir=base))
        try:
            results = launch("shmtrain.bench.checkpoint:_worker", payload["workers"],
                             dict(payload, model=name, dir=str(folder)), threads=payload["threads"])
            validations = []
            for _ in range(payload["reps"]):
                start = time.perf_counter()
                validate(Path(results[0]["path"]))
                validations.append(time.perf_counter() - start)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        iteration = statistics.median(s for r in results for s in r["iterations"])
        save = _slowest(results, "save")
        rows.append({
            "model": name, "workers": payload["workers"], "strategy": payload["strategy"],
            "params_m": results[0]["params"] / 1e6, "mb_per_rank": results[0]["bytes"] / 1e6,
            "mb_total": sum(r["bytes"] for r in results) / 1e6,
            "iteration_s": iteration, "snapshot_s": _slowest(results, "snapshot"), "save_s": save,
            "load_s": _slowest(results, "load"), "validate_s": statistics.median(validations),
            "save_per_iteration": save / iteration,
            "batch_size": payload["batch_size"], "input_shape": payload["input_shape"],
            "threads": payload["threads"], "dir": str(base),
            "samples": {k: [r[k] for r in results] for k in ("iterations", "snapshot", "save", "load")},
        })
    return rows


def _handler(args: argparse.Namespace) -> int:
    if args.workers < 1 or args.iterations < 1 or args.reps < 1 or args.warmup < 0 or args.batch_size < 1:
        raise ValueError(
            f"--workers {args.workers}, --iterations {args.iterations}, --reps {args.reps}, "
            f"--batch-size {args.batch_size} must be at least 1 and --warmup {args.warmup} not "
            "negative; use e.g. --workers 2 --iterations 5 --reps 3 --warmup 1"
        )
    from shmtrain.models import model_names

    unknown = [m for m in args.model if m not in model_names()]
    if unknown:
        raise ValueError(f"--model {' '.join(unknown)}: unknown; choose from {', '.join(model_names())}")
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    if not base.is_dir():
        raise ValueError(f"--dir {args.dir}: no such folder; give an existing folder on the disk to measure")
    payload = {"strategy": args.strategy, "workers": args.workers, "input_shape": args.input_shape,
               "batch_size": args.batch_size, "iterations": args.iterations, "warmup": args.warmup,
               "reps": args.reps, "threads": args.threads}
    rows = run(args.model, payload, base)
    print(table(rows, [("model", "model", "s"), ("params_m", "params M", ".2f"),
                       ("mb_per_rank", "MB/rank", ".1f"), ("iteration_s", "iter s", ".3f"),
                       ("snapshot_s", "snapshot s", ".3f"), ("save_s", "save s", ".3f"),
                       ("load_s", "load s", ".3f"), ("validate_s", "validate s", ".3f"),
                       ("save_per_iteration", "ckpt/iter", ".2f")]))
    print(f"({args.workers} worker(s), {args.strategy}, batch {args.batch_size} of {args.input_shape}, "
          f"{args.threads} thread(s); checkpoints written under {base}; save = snapshot + write + "
          "fsync + rename, slowest rank; goal: ckpt/iter < 2 for resnet18)")
    write_json(args.json, rows)
    return 0


def add_bench_checkpoint_parser(bench: argparse._SubParsersAction) -> None:
    """Register ``shmtrain bench checkpoint``."""
    p = bench.add_parser("checkpoint", help="checkpoint write and resume times vs a training iteration",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=DEFAULT_MODELS,
                   help=f"models (default {' '.join(DEFAULT_MODELS)})")
    p.add_argument("--strategy", default="ssgd", help="strategy of the workers (default ssgd)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--input-shape", default="3x64x64", help="CxHxW of the synthetic batch (default 3x64x64)")
    p.add_argument("--batch-size", type=int, default=32, help="per worker (default 32)")
    p.add_argument("--iterations", type=int, default=5, help="timed training iterations (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations first (default 2)")
    p.add_argument("--reps", type=int, default=3, help="timed checkpoints and resumes (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    p.add_argument("--dir", help="folder the checkpoints are written under (default the temporary folder)")
    p.add_argument("--json", help="write the rows here")
    p.set_defaults(handler=_handler)
