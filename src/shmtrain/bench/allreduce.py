"""``shmtrain bench allreduce``: the shared-memory allreduce against gloo, same host, one run.

For each process count and size: median time of ``ShmAllreduce`` (elementwise sum of
float32 buffers, the same operation as gloo's) and of ``torch.distributed.all_reduce``
over gloo, each sample the slowest
rank's time, beside two floors:

* the memory-traffic floor: every input read once and every output written once
  (``2 * procs * bytes``) at the copy bandwidth measured with all ranks copying at once;
* the read floor, a lower bound for *any* allreduce of inputs that are not in cache:
  every input byte must be read at least once, so the ``procs * bytes`` of inputs
  shared among ``procs`` cores take at least the time of every rank reading ``bytes``
  at once (measured as a dot product of two halves, the fastest read-only kernel we
  found here: reading two streams beats reading one). The column
  ``gloo/read`` is the largest speedup over gloo that any allreduce could reach on this
  machine for that size.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist

from shmtrain.bench.common import (
    copy_bandwidth,
    median,
    parse_size,
    table,
    timed_collective,
    write_json,
)
from shmtrain.fabric.context import ProcessContext
from shmtrain.fabric.shm_allreduce import ShmAllreduce
from shmtrain.runtime.launcher import launch


def _worker(ctx: ProcessContext, payload: dict[str, Any]) -> list[dict[str, Any]]:
    bandwidth = copy_bandwidth()
    rows = []
    for nbytes in payload["sizes"]:
        n = nbytes // 4
        reps = payload["reps"] if nbytes <= 64 << 20 else max(3, payload["reps"] // 2)
        ar = ShmAllreduce(ctx.host, n, op="sum", tag=f"bench{nbytes}")
        shm = timed_collective(ar, reps, 2, before=lambda a=ar: a.input().fill_(1.0),
                               barrier=lambda: ctx.host.barrier("bench"))
        expected = float(ctx.world_size)
        ok = bool(torch.all(ar.result() == expected))
        ar.close()
        del ar
        buf = torch.ones(n)
        gloo = timed_collective(lambda b=buf: dist.all_reduce(b), reps, 1)
        del buf
        floor = 2 * ctx.world_size * nbytes / bandwidth
        # every rank reads its share of the inputs (n elements), all ranks at once, as two
        # streams (a dot product of two halves: the fastest read-only kernel found here)
        halves = torch.ones(n + n % 2).chunk(2)
        read_floor = median(timed_collective(lambda h=halves: torch.dot(*h), reps, 1))
        del halves
        for impl, samples in (("shm", shm), ("gloo", gloo)):
            rows.append({
                "impl": impl, "procs": ctx.world_size, "bytes": nbytes, "median_s": median(samples),
                "min_s": min(samples), "reps": len(samples), "floor_s": floor, "read_floor_s": read_floor,
                "copy_GBps": bandwidth / 1e9, **({"correct": ok} if impl == "shm" else {}),
            })
    return rows


def run(procs: list[int], sizes: list[int], reps: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for p in procs:
        print(f"... {p} processes", flush=True)
        rows += launch("shmtrain.bench.allreduce:_worker", p, {"sizes": sizes, "reps": reps})[0]
    return rows


def comparison(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (procs, bytes) with both implementations side by side."""
    out = []
    for shm in (r for r in rows if r["impl"] == "shm"):
        gloo = next(r for r in rows if r["impl"] == "gloo" and r["procs"] == shm["procs"] and r["bytes"] == shm["bytes"])
        out.append({
            "procs": shm["procs"], "MiB": shm["bytes"] / (1 << 20), "shm_ms": shm["median_s"] * 1e3,
            "gloo_ms": gloo["median_s"] * 1e3, "speedup": gloo["median_s"] / shm["median_s"],
            "floor_ms": shm["floor_s"] * 1e3, "vs_floor": shm["median_s"] / shm["floor_s"],
            "read_floor_ms": shm["read_floor_s"] * 1e3, "max_speedup": gloo["median_s"] / shm["read_floor_s"],
        })
    return out


def _handler(args: argparse.Namespace) -> int:
    procs = args.procs or [2, 4]
    if any(p < 1 for p in procs):
        raise ValueError(f"--procs {procs}: every process count must be at least 1")
    sizes = [parse_size(s) for s in (args.sizes or ["1MiB", "16MiB", "64MiB", "256MiB"])]
    if args.reps < 1:
        raise ValueError(f"--reps {args.reps}: at least 1 repetition is needed")
    rows = run(procs, sizes, args.reps)
    print(table(comparison(rows), [
        ("procs", "procs", "d"), ("MiB", "MiB", ".0f"), ("shm_ms", "shm ms", ".2f"),
        ("gloo_ms", "gloo ms", ".2f"), ("speedup", "gloo/shm", ".1f"), ("floor_ms", "floor ms", ".2f"),
        ("vs_floor", "shm/floor", ".2f"), ("read_floor_ms", "read floor ms", ".2f"),
        ("max_speedup", "gloo/read", ".1f"),
    ]))
    write_json(args.json, rows)
    bad = [r for r in rows if r.get("correct") is False]
    if bad:
        print(f"shmtrain: error: the shared-memory allreduce returned wrong values for {len(bad)} sizes")
        return 1
    return 0


def add_parser(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("allreduce", help="shared-memory allreduce vs gloo, same host",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, nargs="+", help="process counts (default 2 4)")
    p.add_argument("--sizes", nargs="+", help="buffer sizes, e.g. 1MiB 64MiB (default 1MiB 16MiB 64MiB 256MiB)")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions per size (default 10)")
    p.add_argument("--json", help="write the rows here")
    p.set_defaults(handler=_handler)
