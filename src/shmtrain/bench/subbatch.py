"""``shmtrain bench subbatch``: K threads in one process vs K processes, on the same cores.

SUB-BATCH (swCaffe Section V-A, Algorithm 1) splits a worker's mini-batch over K threads
and averages their gradients inside the process; the alternative is K worker processes
that each take batch/K and allreduce. For each K this benchmark launches K processes,
all pinned to the same K cores, and runs three modes in rounds, one iteration of each
per round, in an order rotated every round, with a host barrier (untimed) before each:

- ``1 thread``: rank 0 alone, the whole batch on one thread (``--sub-batch 1``; the
  other processes sleep in the barrier),
- ``K threads``: rank 0 alone, the whole batch over K threads (``--sub-batch K``),
- ``K processes``: every rank, batch/K each, ``ssgd`` (shared-memory allreduce); a sample
  is the slowest rank's iteration.

Each row gives the median milliseconds per iteration, samples per second (the batch over
the median), the speed-up over ``1 thread``, and on the ``K threads`` row the ratio of
its time to ``K processes``' (of the medians, and paired: the median over rounds of the
ratio within a round). Every process runs ``--threads`` torch threads (each sub-batch
thread too).

Run: ``shmtrain bench subbatch --json FILE`` (``--quick``: a smaller, shorter run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
from torch import nn

from shmtrain.bench.common import table, write_json
from shmtrain.fabric.job.context import ProcessContext
from shmtrain.runtime.launch.launcher import launch

ONE, THREADS, PROCESSES = "1 thread", "threads", "processes"


def _worker(ctx: ProcessContext, payload: dict[str, Any]) -> dict[str, Any]:
    from shmtrain.bench.common import synthetic_setup
    from shmtrain.parallel.data_parallel import DataParallel
    from shmtrain.runtime.train.trainer import Trainer
    from shmtrain.timing import PhaseTimer

    os.sched_setaffinity(0, payload["cores"])  # before any sub-batch thread: they inherit it
    parts, batch = payload["parts"], payload["batch_size"]
    loss_fn = nn.CrossEntropyLoss()
    steps: dict[str, Any] = {}
    timers: dict[str, PhaseTimer] = {}
    closers = []

    def add(mode: str, strategy: str, rows: int, sub_batch: int) -> None:
        model, x, y, optimizer = synthetic_setup(payload["model"], payload["input_shape"], rows, ctx.rank)
        timer = timers[mode] = PhaseTimer()
        engine = DataParallel(model, optimizer, strategy, ctx=ctx, timer=timer)
        trainer = Trainer(engine, loss_fn, timer, sub_batch=sub_batch)
        closers.extend([trainer.close, engine.close])
        steps[mode] = lambda: trainer.step(x, y)

    # the strategies' collectives are made in the same order on every rank
    add(PROCESSES, "ssgd", len(torch.empty(batch).tensor_split(parts)[ctx.rank]), 1)
    if ctx.rank == 0:
        add(ONE, "nocomm", batch, 1)
        add(THREADS, "nocomm", batch, parts)
    modes = [ONE, THREADS, PROCESSES]
    samples: dict[str, list[float]] = {m: [] for m in modes}
    phases: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for rnd in range(payload["warmup"] + payload["rounds"]):
        shift = rnd % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            ctx.host.barrier(f"bench subbatch {mode}")
            if mode not in steps:
                continue
            start = time.perf_counter()
            steps[mode]()
            elapsed = time.perf_counter() - start
            record = timers[mode].finish_iteration()
            if rnd >= payload["warmup"]:
                samples[mode].append(elapsed)
                phases[mode].append(record)
    for close in closers:
        close()
    return {"samples": samples, "phases": phases}


def run(parts: int, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """One launch of ``parts`` processes pinned to the same cores; the three rows."""
    allowed = sorted(os.sched_getaffinity(0))
    cores = allowed[:parts]
    load = os.getloadavg()[0]  # other jobs on these cores move every figure: recorded
    results = launch("shmtrain.bench.subbatch:_worker", parts, dict(payload, parts=parts, cores=cores),
                     threads=payload["threads"], timeout=payload.get("timeout", 600))
    rows, per_round = [], {}
    for mode in (ONE, THREADS, PROCESSES):
        ranks = results if mode == PROCESSES else results[:1]
        per_round[mode] = [max(r["samples"][mode][i] for r in ranks) for i in range(payload["rounds"])]
        names = sorted({k for r in ranks for p in r["phases"][mode] for k in p})
        median = statistics.median(per_round[mode])
        rows.append({
            "parts": parts, "mode": mode if mode == ONE else f"{parts} {mode}",
            "processes": len(ranks), "threads_per_process": parts if mode == THREADS else 1,
            "torch_threads": payload["threads"], "cores": cores, "model": payload["model"],
            "input_shape": payload["input_shape"], "batch_size": payload["batch_size"],
            "rounds": payload["rounds"], "median_ms": 1e3 * median, "min_ms": 1e3 * min(per_round[mode]),
            "samples_per_s": payload["batch_size"] / median,
            "phases_ms": {k: 1e3 * statistics.fmean(p.get(k, 0.0) for r in ranks for p in r["phases"][mode])
                          for k in names},
            "samples_s": per_round[mode],
            "load_average": [load, os.getloadavg()[0]],
        })
    one, threads, processes = rows
    for row in rows:
        row["speedup"] = one["median_ms"] / row["median_ms"]
    threads["threads_vs_processes"] = threads["median_ms"] / processes["median_ms"]
    threads["paired_threads_vs_processes"] = statistics.median(
        a / b for a, b in zip(per_round[THREADS], per_round[PROCESSES], strict=True))
    return rows


def _handler(args: argparse.Namespace) -> int:
    if args.quick:
        args.input_shape, args.batch_size, args.rounds, args.warmup = "3x16x16", 32, 6, 1
    if any(k < 2 for k in args.parts):
        raise ValueError(f"--parts {args.parts}: each K must be at least 2 (K = 1 is the '1 thread' row "
                         "of every launch); use e.g. --parts 2")
    if any(k > args.batch_size for k in args.parts):
        raise ValueError(f"--parts {args.parts}: each of the K threads or processes needs at least 1 of "
                         f"the --batch-size {args.batch_size} samples; use a smaller K or a larger batch")
    if args.rounds < 1 or args.warmup < 0 or args.threads < 1:
        raise ValueError(f"--rounds {args.rounds}, --warmup {args.warmup}, --threads {args.threads}: "
                         "--rounds and --threads must be at least 1 and --warmup not negative")
    cores = len(os.sched_getaffinity(0))
    payload = {"model": args.model, "input_shape": args.input_shape, "batch_size": args.batch_size,
               "rounds": args.rounds, "warmup": args.warmup, "threads": args.threads}
    rows = []
    for k in args.parts:
        note = "" if k <= cores else f" (only {cores} cores: oversubscribed)"
        print(f"... K = {k}: {k} threads in 1 process vs {k} processes on {min(k, cores)} cores{note}", flush=True)
        rows.extend(run(k, payload))
    print(table(rows, [("parts", "K", "d"), ("mode", "mode", "s"), ("median_ms", "ms/iter", ".1f"),
                       ("min_ms", "min ms", ".1f"), ("samples_per_s", "samples/s", ".1f"),
                       ("speedup", "vs 1 thread", ".2f"), ("threads_vs_processes", "thr/proc", ".3f"),
                       ("paired_threads_vs_processes", "paired", ".3f")]))
    print(f"1-minute load average before and after: {rows[0]['load_average'][0]:.1f}, "
          f"{rows[-1]['load_average'][1]:.1f} (on {cores} cores)")
    write_json(args.json, rows)
    return 0


def add_bench_subbatch_parser(bench: argparse._SubParsersAction) -> None:
    """Register ``shmtrain bench subbatch``."""
    p = bench.add_parser("subbatch", help="K threads in one process (--sub-batch K) vs K processes, same cores",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smallcnn", help="model name (default smallcnn)")
    p.add_argument("--input-shape", default="3x32x32", help="CxHxW of the synthetic batch (default 3x32x32)")
    p.add_argument("--batch-size", type=int, default=64, help="per worker: the whole batch of the one process, "
                   "split over K threads or K processes (default 64)")
    p.add_argument("--parts", type=int, nargs="+", default=[2], metavar="K", help="values of K (default 2)")
    p.add_argument("--rounds", type=int, default=20, help="timed rounds, one iteration of each mode (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process and per sub-batch thread "
                   "(default 1)")
    p.add_argument("--quick", action="store_true", help="3x16x16, batch 32, 6 rounds, 1 warm-up (the tests run it)")
    p.add_argument("--json", help="write the rows here")
    p.set_defaults(handler=_handler)
