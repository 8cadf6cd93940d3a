"""``shmtrain bench smb`` and ``shmtrain bench seasgd``: the buffer service and SEASGD's overlap.

``bench smb`` (ShmCaffe Fig. 7): every process has its own buffer of ``--size`` bytes
on the buffer service and reads it, writes it, or both in turn (the paper's 50/50
read/write mix), all processes at once; the aggregate bandwidth is every process's
bytes over the slowest process's time. ``accumulate`` has every process add its
buffer into one shared buffer through the service's single owner (serialized, as the
paper's memory server). ``copy`` is a plain private copy of the same size by every
process at once: the memory bandwidth the service is up against.

``bench seasgd`` trains with ``seasgd`` (``update_interval`` 1 by default) and reports
per worker the eq. (8) check and the exposed communication: the time the main thread
waits for the update thread plus T_rgw and T_ulw, as a share of the iteration.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from shmtrain.bench.common import bench_buffers, median, parse_size, table, timed_rounds, write_json
from shmtrain.fabric.job.context import ProcessContext
from shmtrain.fabric.smb import LocalBufferService
from shmtrain.runtime.launch.launcher import launch

OPS = ("read", "write", "readwrite", "accumulate", "copy")
REMOTE_OPS = ("read", "write", "readwrite", "accumulate")


def _slowest(ctx: ProcessContext, seconds: float) -> float:
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64)
    if ctx.world_size > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _worker(ctx: ProcessContext, payload: dict[str, Any]) -> list[dict[str, Any]]:
    nbytes, reps, samples = payload["bytes"], payload["reps"], payload["samples"]
    numel = nbytes // 4
    smb = LocalBufferService(ctx.host)
    shared, own = bench_buffers(smb, numel)
    private = torch.ones(numel)
    other = torch.empty(numel)

    def accumulate() -> None:
        smb.wait(smb.accumulate(own, shared))

    ops = {
        "read": lambda: smb.read(own, private),
        "write": lambda: smb.write(own, private),
        "readwrite": None,
        "accumulate": accumulate,
        "copy": lambda: other.copy_(private),
    }
    rows = []
    for op in payload["ops"]:
        def one(i: int, op: str = op) -> None:
            if op == "readwrite":
                (ops["read"] if i % 2 == 0 else ops["write"])()
            else:
                ops[op]()

        times = timed_rounds(one, reps, samples, lambda op=op: ctx.host.barrier(f"bench {op}"),
                             lambda t: _slowest(ctx, t))
        seconds = median(times)
        rows.append({
            "procs": ctx.world_size, "op": op, "bytes": nbytes,
            "aggregate_GBps": ctx.world_size * reps * nbytes / seconds / 1e9,
            "median_s": seconds, "reps": reps,
        })
    smb.close()
    return rows


def run_smb(procs: list[int], nbytes: int, reps: int, samples: int, ops: list[str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for p in procs:
        print(f"... {p} processes", flush=True)
        payload = {"bytes": nbytes, "reps": reps, "samples": samples, "ops": ops}
        rows += launch("shmtrain.bench.smb:_worker", p, payload, timeout=600)[0]
    return rows


def _smb_handler(args: argparse.Namespace) -> int:
    procs = args.procs or ([1, 2, 4] if args.remote else [1, 2, 4, 8])
    if any(p < 1 for p in procs):
        raise ValueError(f"--procs {procs}: every process count must be at least 1")
    nbytes = parse_size(args.size)
    if nbytes < 4:
        raise ValueError(f"--size {args.size}: at least one float32 (4 bytes) is needed")
    if args.reps < 1 or args.samples < 1:
        raise ValueError(f"--reps {args.reps} / --samples {args.samples}: each must be at least 1")
    known = REMOTE_OPS if args.remote else OPS
    ops = args.ops or list(known)
    unknown = sorted(set(ops) - set(known))
    if unknown:
        raise ValueError(f"--ops {' '.join(unknown)}: unknown{' with --remote' if args.remote else ''}; "
                         f"choose from {' '.join(known)}")
    if args.remote:
        from shmtrain.bench import smb_remote

        rows = smb_remote.run(procs, nbytes, args.reps, args.samples, ops)
        print(table(rows, [("procs", "clients", "d"), ("op", "op", "s"), ("bytes", "bytes", "d"),
                           ("aggregate_GBps", "GB/s", ".3f"), ("vs_gloo", "vs gloo", ".2f")]))
        write_json(args.json, rows)
        return 0
    rows = run_smb(procs, nbytes, args.reps, args.samples, ops)
    copy = {r["procs"]: r["aggregate_GBps"] for r in rows if r["op"] == "copy"}
    for row in rows:
        if row["procs"] in copy:
            row["vs_copy"] = row["aggregate_GBps"] / copy[row["procs"]]
    print(table(rows, [("procs", "procs", "d"), ("op", "op", "s"), ("bytes", "bytes", "d"),
                       ("aggregate_GBps", "GB/s", ".2f"), ("vs_copy", "vs copy", ".2f")]))
    write_json(args.json, rows)
    return 0


def add_bench_smb_parser(bench: argparse._SubParsersAction) -> None:
    """Register ``shmtrain bench smb``."""
    p = bench.add_parser("smb", help="buffer service read/write/accumulate bandwidth vs processes (Fig. 7)",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, nargs="+", help="process counts (default 1 2 4 8)")
    p.add_argument("--size", default="64MiB", help="buffer per process (default 64MiB; the paper: 1GB)")
    p.add_argument("--reps", type=int, default=10, help="operations per timed sample (default 10)")
    p.add_argument("--samples", type=int, default=3, help="timed samples, median kept (default 3)")
    p.add_argument("--ops", nargs="+", help=f"subset of {' '.join(OPS)} (default all; --remote: no copy)")
    p.add_argument("--remote", action="store_true",
                   help="the remote service (SMB-REMOTE): a memory server here and the processes as its "
                        "clients, beside gloo send/recv between the same endpoints (default --procs 1 2 4)")
    p.add_argument("--json", help="write the rows here")
    p.set_defaults(handler=_smb_handler)


# -- bench seasgd: eq. (8) and the exposed communication --------------------------------
def eq8_rows(out: Path, skip: int = 2) -> list[dict[str, Any]]:
    """check_eq8 per rank of a finished run folder."""
    from shmtrain.runtime.outputs.report import read_metrics
    from shmtrain.strategies.elastic.eq8 import check_eq8

    return [{"rank": rank, **check_eq8(rows, skip=skip)} for rank, rows in sorted(read_metrics(out).items())]


def _seasgd_handler(args: argparse.Namespace) -> int:
    from shmtrain.runtime.config import resolve
    from shmtrain.runtime.run.training import run_training

    out = Path(args.out or f"runs/bench-seasgd-{time.strftime('%Y%m%d-%H%M%S')}")
    values = {
        "strategy": "seasgd", "workers": args.workers, "model": args.model, "data": args.data,
        "input_shape": args.input_shape, "batch_size": args.batch_size, "iterations": args.iterations,
        "out": str(out), "progress": False, "update_interval": args.update_interval,
        "moving_rate": args.moving_rate, "lr": args.lr,
    }
    run_training(resolve(values))
    rows = eq8_rows(out)
    print("\nShmCaffe eq. (8) per worker (ms per iteration):")
    ms = [{k: v * 1e3 if k.startswith("T_") or k == "exposed_comm" else v for k, v in r.items()} for r in rows]
    print(table(ms, [("rank", "rank", "d"), ("T_comp", "comp", ".1f"), ("T_wwi", "wwi", ".1f"),
                     ("T_ugw", "ugw", ".1f"), ("T_rgw", "rgw", ".1f"), ("T_ulw", "ulw", ".1f"),
                     ("T_wait", "wait", ".1f"), ("T_iter", "iter", ".1f"), ("T_iter_eq8", "eq8", ".1f"),
                     ("exposed_fraction", "exposed", ".3f"), ("holds", "eq8 ok", "")]))
    write_json(args.json, rows)
    return 0


def add_bench_seasgd_parser(bench: argparse._SubParsersAction) -> None:
    """Register ``shmtrain bench seasgd``."""
    p = bench.add_parser("seasgd", help="SEASGD exposed communication and the eq. (8) check",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="local worker processes (default 2)")
    p.add_argument("--model", default="resnet18", help="the model, as shmtrain train --model takes it "
                                                       "(default resnet18)")
    p.add_argument("--data", default="synthetic", help="the data, as shmtrain train --data takes it "
                                                      "(default synthetic)")
    p.add_argument("--input-shape", default="3x64x64", help="CxHxW of the synthetic inputs (default 3x64x64)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per worker per iteration (default 32)")
    p.add_argument("--iterations", type=int, default=20, help="iterations per worker; the first 2 are left "
                                                              "out of the check (default 20)")
    p.add_argument("--update-interval", type=int, default=1,
                   help="SEASGD's tau: iterations between a worker's exchanges with W_g (default 1)")
    p.add_argument("--moving-rate", type=float, default=0.2,
                   help="SEASGD's alpha in (0, 1]: the share of the difference to W_g moved each way (default 0.2)")
    p.add_argument("--lr", type=float, default=0.01, help="learning rate of each worker's SGD (default 0.01)")
    p.add_argument("--out", help="run folder (default runs/bench-seasgd-<time>)")
    p.add_argument("--json", help="write the rows here")
    p.set_defaults(handler=_seasgd_handler)
