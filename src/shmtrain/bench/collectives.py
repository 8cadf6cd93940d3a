"""``shmtrain bench collectives``: every allreduce algorithm on this host, side by side.

For each process count and buffer size, in one run: the schedule algorithms (ring,
rhd, tree, topo, hierarchical) over gloo point-to-point (:class:`GlooTransport`),
torch.distributed's own ``all_reduce`` over gloo, and the shared-memory allreduce
(:class:`ShmAllreduce`). Each sample is the slowest rank's time of one float32 sum
allreduce, after a barrier; repetitions interleave the implementations; the table
shows medians (the JSON also has minima). Every result is checked.

topo and hierarchical need groups: by default the whole host is one group (what
training uses: groups = hosts), where topo is rhd and hierarchical is tree;
``--group-size`` splits the local processes into pretend groups to exercise them
(the links are the same on one host, so only the pattern changes).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist

from shmtrain.argtypes import comma_list
from shmtrain.bench.common import median, parse_size, table, timed_collective, write_json
from shmtrain.fabric.allreduce.collectives.algorithms import ALGORITHMS
from shmtrain.fabric.allreduce.collectives.reducers import GlooAllreduce, ScheduledAllreduce
from shmtrain.fabric.allreduce.collectives.schedule import Topology
from shmtrain.fabric.allreduce.collectives.transport import GlooTransport
from shmtrain.fabric.job.context import ProcessContext
from shmtrain.runtime.launch.launcher import launch

IMPLEMENTATIONS = ("shm", "gloo", *ALGORITHMS)


def _build(name: str, ctx: ProcessContext, numel: int, topology: Topology, tag: str):
    if name == "shm":
        from shmtrain.fabric.allreduce.shared import ShmAllreduce

        return ShmAllreduce(ctx.host, numel, op="sum", tag=tag)
    if name == "gloo":
        return GlooAllreduce(numel, op="sum")
    return ScheduledAllreduce(
        name, GlooTransport(timeout=ctx.timeout), numel, op="sum", topology=topology
    )


def _worker(ctx: ProcessContext, payload: dict[str, Any]) -> list[dict[str, Any]]:
    group_size = payload["group_size"] or ctx.world_size
    topology = Topology.uniform(ctx.world_size, group_size)
    expected = ctx.world_size * (ctx.world_size + 1) / 2
    fill = float(ctx.rank + 1)
    rows = []
    for nbytes in payload["sizes"]:
        numel = nbytes // 4
        reps = payload["reps"] if nbytes <= 16 << 20 else max(3, payload["reps"] // 2)
        impls = {name: _build(name, ctx, numel, topology, f"bench-{name}-{nbytes}")
                 for name in payload["impls"]}
        samples: dict[str, list[float]] = {name: [] for name in impls}
        # Interleaved (every implementation once per repetition), so the load of a shared
        # machine drifting during the run hits them all alike.
        for rep in range(2 + reps):
            for name, ar in impls.items():
                got = timed_collective(ar, 1, 0, before=lambda a=ar: a.input().fill_(fill))
                if rep >= 2:
                    samples[name] += got
        for name, ar in impls.items():
            ok = bool(torch.all(ar.result() == expected))
            rows.append({
                "impl": name, "procs": ctx.world_size, "group_size": group_size, "bytes": nbytes,
                "median_s": median(samples[name]), "min_s": min(samples[name]),
                "reps": len(samples[name]), "correct": ok,
            })
            if hasattr(ar, "close"):
                ar.close()
        del impls
    dist.barrier()
    return rows


def run(procs: list[int], sizes: list[int], reps: int, impls: list[str],
        group_size: int | None) -> list[dict[str, Any]]:
    """Launch each process count once; return one row per (procs, bytes, impl)."""
    rows: list[dict[str, Any]] = []
    for p in procs:
        print(f"... {p} processes", flush=True)
        payload = {"sizes": sizes, "reps": reps, "impls": impls,
                   "group_size": group_size if group_size and p % group_size == 0 else None}
        rows += launch("shmtrain.bench.collectives:_worker", p, payload)[0]
    return rows


def side_by_side(rows: list[dict[str, Any]], impls: list[str]) -> list[dict[str, Any]]:
    """One row per (procs, bytes): each implementation's median in ms, and the fastest."""
    out = []
    keys = list(dict.fromkeys((r["procs"], r["bytes"]) for r in rows))
    for procs, nbytes in keys:
        mine = {r["impl"]: r for r in rows if r["procs"] == procs and r["bytes"] == nbytes}
        row: dict[str, Any] = {"procs": procs, "MiB": nbytes / (1 << 20)}
        for name in impls:
            row[name] = mine[name]["median_s"] * 1e3
        best = min(impls, key=lambda n: mine[n]["median_s"])
        row["best"] = best
        row["gloo/best"] = mine["gloo"]["median_s"] / mine[best]["median_s"] if "gloo" in mine else None
        out.append(row)
    return out


def _handler(args: argparse.Namespace) -> int:
    procs = args.procs or [2, 4]
    if any(p < 1 for p in procs):
        raise ValueError(f"--procs {procs}: every process count must be at least 1")
    if args.reps < 1:
        raise ValueError(f"--reps {args.reps}: at least 1 repetition is needed")
    if args.group_size is not None and (
        args.group_size < 1 or any(p % args.group_size for p in procs)
    ):
        raise ValueError(
            f"--group-size {args.group_size} must divide every process count of --procs "
            f"{' '.join(map(str, procs))}; e.g. --group-size 2 with --procs 2 4"
        )
    sizes = [parse_size(s) for s in (args.sizes or ["64KiB", "1MiB", "16MiB"])]
    if any(s < 4 for s in sizes):
        raise ValueError("--sizes: every size must hold at least one float32 (4 bytes)")
    impls = args.impls or list(IMPLEMENTATIONS)
    rows = run(procs, sizes, args.reps, impls, args.group_size)
    columns = [("procs", "procs", "d"), ("MiB", "MiB", ".3g")]
    columns += [(name, f"{name} ms", ".2f") for name in impls]
    columns += [("best", "best", "s"), ("gloo/best", "gloo/best", ".1f")]
    print(table(side_by_side(rows, impls), columns))
    write_json(args.json, rows)
    bad = [r for r in rows if not r["correct"]]
    if bad:
        names = sorted({f"{r['impl']}@{r['procs']}" for r in bad})
        print(f"shmtrain: error: wrong allreduce results from {', '.join(names)}")
        return 1
    return 0


def add_bench_collectives_parser(bench: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``collectives`` to the ``shmtrain bench`` sub-commands."""
    p = bench.add_parser(
        "collectives", help="ring/rhd/tree/topo/hierarchical over gloo p2p vs gloo vs shm",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--procs", type=int, nargs="+", help="process counts (default 2 4)")
    p.add_argument("--sizes", nargs="+",
                   help="buffer sizes, e.g. 64KiB 1MiB 16MiB (the default)")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions per size (default 10)")
    p.add_argument("--impls", type=comma_list("allreduce", IMPLEMENTATIONS),
                   help=f"comma-separated subset of {','.join(IMPLEMENTATIONS)} (default all)")
    p.add_argument("--group-size", type=int,
                   help="processes per pretend group for topo/hierarchical (default: all)")
    p.add_argument("--json", help="write the rows here")
    p.set_defaults(handler=_handler)
    return p
