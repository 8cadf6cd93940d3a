"""``shmtrain bench allreduce``: shmtrain's allreduce against every peer, same host, one run.

For each process count and size (float32 sum; each sample the slowest rank's time;
median and p90): shmtrain zero-copy (``ShmAllreduce``: the inputs already in shared
slots, how shmtrain's strategies use it), shmtrain with private tensors
(``reduce_private``: a tensor in, the sum back in it, as ``all_reduce``, DDP, MPI and
DeepSpeed offer; the pipelined path of :mod:`shmtrain.fabric.allreduce.pipeline`), and
the peers of :mod:`shmtrain.bench.peers` (gloo, MPICH, DeepSpeed's shared-memory op),
with ratios against the best peer, beside two floors:

* the memory-traffic floor: every input read once and every output written once
  (``2 * procs * bytes``) at the copy bandwidth measured with all ranks copying at once;
* the read floor, a lower bound for *any* allreduce of inputs that are not in cache:
  every input byte must be read at least once, so the ``procs * bytes`` of inputs
  shared among ``procs`` cores take at least the time of every rank reading ``bytes``
  at once (measured as a dot product of two halves, the fastest read-only kernel we
  found here: reading two streams beats reading one). The column
  ``gloo/read`` is the largest speedup over gloo that any allreduce could reach on this
  machine for that size;
* the result floor: every rank reading its ``bytes`` and writing its ``1/procs`` of the
  result (``procs`` private rows added into the first in place with the zero-copy
  reduction's own kernel, all ranks at once after a barrier): that kernel on cache-warm
  private rows, without synchronisation;
* the fresh-read floor: every rank reads its chunk of every rank's shared slot right
  after the owners wrote it (the zero-copy reduction's own reads, with the cache lines
  still where the writers left them), no arithmetic, then one one-float barrier (so the
  sample ends when the last rank has read, as a result that needs every chunk does):
  inputs that other cores just produced cannot be gathered faster than this.

Every row also carries ``cpu_s``, the CPU seconds per call summed over the ranks (the
process time of every thread, around the call only: a rank that busy-waits pays for it
here), and the private path's rows the algorithm its plan chose
(:mod:`shmtrain.fabric.allreduce.plan`: all-read, split or two-level, and the block).
Every peer's rows are checked (:func:`shmtrain.bench.peers.validate`: a world of
``--procs`` ranks, the exact sum at every size); one that fails is reported invalid with
the reason and never ranked.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
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
from shmtrain.bench.peers import (
    EXTERNAL,
    PEERS,
    expected_sum,
    reps_for,
    run_peer,
    summarize,
    validate,
)
from shmtrain.fabric import native
from shmtrain.fabric.allreduce import machine_model
from shmtrain.fabric.allreduce.pipeline import PipelinedAllreduce
from shmtrain.fabric.allreduce.shared import ShmAllreduce
from shmtrain.fabric.job.context import ProcessContext
from shmtrain.fabric.shm.affinity import bind
from shmtrain.fabric.shm.control import MAX_CHANNELS
from shmtrain.runtime.launch.launcher import launch


def _worker(ctx: ProcessContext, payload: dict[str, Any]) -> list[dict[str, Any]]:
    if payload.get("bind"):
        bind(ctx.local_rank, ctx.local_world)
    bandwidth = copy_bandwidth()
    rows = []
    # the samples start after a one-float allreduce: the fastest barrier shmtrain has (the
    # Python barrier's wake-ups left 4 ranks on 2 cores out of step by tens of microseconds,
    # which the next sample timed; MPICH's samples start after its compiled MPI_Barrier)
    token, gate = torch.zeros(1), PipelinedAllreduce(ctx.host, tag="bench.barrier")
    for nbytes in payload["sizes"]:
        n = nbytes // 4
        reps = reps_for(nbytes, payload["reps"])
        ar = ShmAllreduce(ctx.host, n, op="sum", tag=f"bench{nbytes}")
        shm, shm_cpu = _timed(ar, reps, 2, before=lambda a=ar: a.input().fill_(1.0), barrier=lambda: gate(token))
        expected = float(ctx.world_size)
        ok = bool(torch.all(ar.result() == expected))
        gate(token)  # every rank has checked the result before its slot is written again
        fresh = median(timed_collective(lambda a=ar: (_read_share(a, ctx.local_rank), gate(token)), reps, 1,
                                        before=lambda a=ar: a.input(a.count).fill_(1.0),
                                        barrier=lambda: gate(token)))
        mine = torch.ones(n)
        private, private_cpu = _timed(lambda a=ar, t=mine: a.reduce_private(t), reps, 2,
                                      before=lambda t=mine: t.fill_(1.0), barrier=lambda: gate(token))
        ok_private = bool(torch.all(mine == expected))
        plan = ar.pipeline.last_plan if ar.pipeline is not None else None
        algorithm = plan.describe() if plan is not None else "-"
        ar.close()
        del ar
        gloo = []
        if "gloo" in payload["peers"]:
            buf = torch.ones(n)
            fill = float(ctx.rank + 1)  # as every peer: rank + 1, so a sum of the wrong ranks shows
            gloo, gloo_cpu = _timed(lambda b=buf: dist.all_reduce(b), reps, 1, before=lambda b=buf, f=fill: b.fill_(f))
            ok_gloo = bool(torch.all(buf == expected_sum(ctx.world_size)))
            del buf
        floor = 2 * ctx.world_size * nbytes / bandwidth
        # every rank reads its share of the inputs (n elements), all ranks at once, as two
        # streams (a dot product of two halves: the fastest read-only kernel found here)
        halves = torch.ones(n + n % 2).chunk(2)
        read_floor = median(timed_collective(lambda h=halves: torch.dot(*h), reps, 1, barrier=lambda: gate(token)))
        del halves
        # ... and writes its 1/procs of the result: the split reduction's own traffic
        L = ctx.world_size
        rows_in = torch.ones(L, -(-n // L))
        result_floor = median(timed_collective(lambda r=rows_in: _sum_rows(r), reps, 1, barrier=lambda: gate(token)))
        del rows_in
        for impl, samples, cpu, correct, alg in (
                ("shm", shm, shm_cpu, ok, "zero-copy split"), ("shm-private", private, private_cpu, ok_private,
                                                               algorithm),
                *((("gloo", gloo, gloo_cpu, ok_gloo, "-"),) if gloo else ())):
            rows.append({
                "impl": impl, "procs": ctx.world_size, "bytes": nbytes, **summarize(samples),
                "min_s": min(samples), "reps": len(samples), "floor_s": floor, "read_floor_s": read_floor,
                "result_floor_s": result_floor, "fresh_read_floor_s": fresh,
                "copy_GBps": bandwidth / 1e9, "correct": correct, "cpu_s": cpu, "algorithm": alg,
                "world_size": dist.get_world_size() if impl == "gloo" else ctx.world_size,
            })
    gate.close()
    return rows


def _timed(fn: Callable[[], Any], reps: int, warmup: int, before: Callable[[], Any] | None = None,
           barrier: Callable[[], Any] | None = None) -> tuple[list[float], float]:
    """:func:`~shmtrain.bench.common.timed_collective`'s samples (each the slowest rank's
    time), and the CPU seconds per call summed over the ranks (process time of every
    thread of each rank, around ``fn`` only)."""
    local, cpu = [], 0.0
    for i in range(warmup + reps):
        if before is not None:
            before()
        (barrier or dist.barrier)()
        cpu_start = time.process_time()
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            local.append(elapsed)
            cpu += time.process_time() - cpu_start
    samples = torch.tensor(local, dtype=torch.float64)
    total = torch.tensor([cpu / reps], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(samples, op=dist.ReduceOp.MAX)
        dist.all_reduce(total)
    return samples.tolist(), float(total)


def _read_share(ar: ShmAllreduce, rank: int) -> None:
    """Read this rank's chunk of every rank's slot (the set just written by their owners):
    the zero-copy reduction's reads, no arithmetic and no hand-off after them."""
    lo, hi = ar.chunks[rank]
    half = (hi - lo) // 2
    for slot in ar.slots[ar.count % 2]:
        torch.dot(slot[lo:lo + half], slot[lo + half:lo + 2 * half])


def _sum_rows(rows: torch.Tensor) -> None:
    """``rows[0] += rows[1] + ...`` in place with the zero-copy reduction's own kernel
    (``shm_sum_into_f32`` where it is built, else one torch ``add_`` per row)."""
    if native.sum_into(rows[0], list(rows[1:])):
        return
    for row in rows[1:]:
        rows[0].add_(row)


def run(procs: list[int], sizes: list[int], reps: int, peers: list[str] | None = None,
        bind_cores: bool = True) -> list[dict[str, Any]]:
    """shmtrain's allreduce (zero-copy and private) and every peer in ``peers``, at each
    process count, every rank of every implementation pinned to its share of the cores
    when ``bind_cores``; a peer that cannot run gets a row with its ``reason``."""
    peers = list(PEERS) if peers is None else peers
    rows: list[dict[str, Any]] = []
    for p in procs:
        print(f"... {p} processes: shmtrain{' and gloo' if 'gloo' in peers else ''}", flush=True)
        ours = launch("shmtrain.bench.allreduce:_worker", p,
                      {"sizes": sizes, "reps": reps, "peers": peers, "bind": bind_cores})[0]
        rows += [r for r in ours if r["impl"] != "gloo"]
        results = {"gloo": {"rows": [r for r in ours if r["impl"] == "gloo"]}} if "gloo" in peers else {}
        for peer in (q for q in peers if q in EXTERNAL):
            print(f"... {p} processes: {peer}", flush=True)
            results[peer] = run_peer(peer, p, sizes, reps, bind=bind_cores)
        for peer, result in results.items():
            rows += peer_rows(peer, p, sizes, result)
    return rows


def peer_rows(peer: str, procs: int, sizes: list[int], result: dict[str, Any]) -> list[dict[str, Any]]:
    """A peer's rows for the table and the JSON: its measured rows if they pass
    :func:`~shmtrain.bench.peers.validate`, else one row with the reason (and the rejected
    rows under ``rejected``), which :func:`comparison` never ranks."""
    reason = result.get("reason") or validate(result["rows"], procs, sizes)
    if reason is None:
        return [dict(r, impl=peer, procs=procs) for r in result["rows"]]
    print(f"    {peer} at {procs} processes: {reason}", flush=True)
    row = {"impl": peer, "procs": procs, "reason": reason}
    if result.get("rows"):
        row.update(invalid=True, rejected=result["rows"])
    return [row]


def comparison(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (procs, bytes): every implementation's median side by side, the best
    peer, and shmtrain's ratios against it (below 1: shmtrain is faster)."""
    out = []
    measured = [r for r in rows if "median_s" in r]
    for shm in (r for r in measured if r["impl"] == "shm"):
        same = {r["impl"]: r for r in measured if r["procs"] == shm["procs"] and r["bytes"] == shm["bytes"]}
        peers = {k: v for k, v in same.items() if k in PEERS and v.get("correct") is True}
        best = min(peers, key=lambda k: peers[k]["median_s"]) if peers else None
        row = {"procs": shm["procs"], "size": _size(shm["bytes"]), "bytes": shm["bytes"],
               "shm_ms": shm["median_s"] * 1e3, "private_ms": same["shm-private"]["median_s"] * 1e3,
               "read_floor_ms": shm["read_floor_s"] * 1e3, "vs_read_floor": shm["median_s"] / shm["read_floor_s"],
               "result_floor_ms": shm["result_floor_s"] * 1e3,
               "vs_result_floor": shm["median_s"] / shm["result_floor_s"],
               "fresh_read_floor_ms": shm["fresh_read_floor_s"] * 1e3,
               "vs_fresh_read_floor": shm["median_s"] / shm["fresh_read_floor_s"],
               "private_algorithm": same["shm-private"].get("algorithm"),
               "private_cpu_ms": same["shm-private"]["cpu_s"] * 1e3 if "cpu_s" in same["shm-private"] else None}
        for peer in PEERS:
            row[f"{peer}_ms"] = peers[peer]["median_s"] * 1e3 if peer in peers else None
        if best is not None:
            row["best_peer"] = best
            row["private_vs_best"] = same["shm-private"]["median_s"] / peers[best]["median_s"]
            row["shm_vs_best"] = shm["median_s"] / peers[best]["median_s"]
            row["best_peer_cpu_ms"] = peers[best]["cpu_s"] * 1e3 if "cpu_s" in peers[best] else None
        out.append(row)
    return out


def _size(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return f"{nbytes}B"


#: sizes one run can take: each uses 5 control channels (zero-copy 3, private 2) of the
#: host's MAX_CHANNELS, beside the host barrier's and the sample gate's 3
MAX_SIZES = (MAX_CHANNELS - 3) // 5
DEFAULT_SIZES = ["4KiB", "16KiB", "64KiB", "256KiB", "1MiB", "4MiB", "16MiB", "64MiB", "256MiB"]


def _handler(args: argparse.Namespace) -> int:
    procs = args.procs or [2, 4]
    if any(p < 1 for p in procs):
        raise ValueError(f"--procs {procs}: every process count must be at least 1")
    sizes = [parse_size(s) for s in (args.sizes or DEFAULT_SIZES)]
    if len(sizes) > MAX_SIZES:
        raise ValueError(f"--sizes: {len(sizes)} sizes, at most {MAX_SIZES} per run (each takes 5 of the host's "
                         f"{MAX_CHANNELS} control channels); run the others in a second command")
    if any(s < 4 for s in sizes):
        raise ValueError(f"--sizes {args.sizes}: every size must hold at least one float32 (4 bytes)")
    if args.reps < 1:
        raise ValueError(f"--reps {args.reps}: at least 1 repetition is needed")
    peers = list(PEERS) if args.peers is None else args.peers
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ValueError(f"--peers {' '.join(unknown)}: unknown; choose from {' '.join(PEERS)} "
                         "(mpich and deepspeed need `pip install 'shmtrain[peers]'`)")
    model = machine_model.machine(remeasure=args.remeasure)
    print(f"shmtrain: the private path's cost model of this machine ({machine_model.cache_path()}): "
          f"{len(model.cores)} cores in {len(model.nodes)} NUMA node(s), copy {model.copy_one_Bps / 1e9:.1f} GB/s "
          f"one core, {model.copy_all_Bps / 1e9:.1f} GB/s all, hand-off {model.handoff_s * 1e6:.1f} us spinning, "
          f"{model.wake_s * 1e6:.1f} us sleeping, cache {model.cache_bytes >> 20} MiB", flush=True)
    rows = run(procs, sizes, args.reps, peers, bind_cores=args.bind == "core")
    print(table(comparison(rows), [
        ("procs", "procs", "d"), ("size", "size", "s"), ("shm_ms", "shm ms", ".3f"),
        ("private_ms", "private ms", ".3f"), ("gloo_ms", "gloo ms", ".3f"), ("mpich_ms", "mpich ms", ".3f"),
        ("deepspeed_ms", "deepspeed ms", ".3f"), ("best_peer", "best peer", "s"),
        ("private_vs_best", "private/best", ".2f"), ("shm_vs_best", "shm/best", ".2f"),
        ("private_algorithm", "private alg", "s"), ("private_cpu_ms", "private cpu ms", ".3f"),
        ("best_peer_cpu_ms", "best cpu ms", ".3f"),
        ("vs_read_floor", "shm/read floor", ".2f"), ("vs_result_floor", "shm/result floor", ".2f"),
        ("vs_fresh_read_floor", "shm/fresh read", ".2f"),
    ]))
    for row in (r for r in rows if "reason" in r):
        print(f"{row['impl']} at {row['procs']} processes{' (not ranked)' if row.get('invalid') else ''}: "
              f"{row['reason']}")
    write_json(args.json, rows)
    bad = [r for r in rows if r.get("correct") is False]
    if bad:
        print(f"shmtrain: error: wrong sums from {sorted({(r['impl'], r['bytes']) for r in bad})}")
        return 1
    return 0


def add_parser(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("allreduce", help="shared-memory allreduce vs gloo, MPICH and DeepSpeed, same host",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, nargs="+", help="process counts (default 2 4)")
    p.add_argument("--sizes", nargs="+", help="buffer sizes, e.g. 1MiB 64MiB (default 4KiB to 256MiB, x4 steps)")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions per size (default 10; half above 64MiB)")
    p.add_argument("--peers", nargs="*", help=f"peers to run beside shmtrain, of {' '.join(PEERS)} (default all; "
                                              "mpich and deepspeed: pip install 'shmtrain[peers]')")
    p.add_argument("--bind", choices=["core", "none"], default="core",
                   help="core (default): every rank of every implementation pinned to core rank mod cores, "
                        "as MPI's -bind-to core; none: where the scheduler likes (with more ranks than "
                        "cores the latency then changes from launch to launch)")
    p.add_argument("--remeasure", action="store_true",
                   help="measure the private path's cost model of this machine again (copy bandwidth, "
                        "hand-off latency, NUMA nodes; ~0.3 s) and replace the cached one")
    p.add_argument("--json", help="write the rows here")
    p.set_defaults(handler=_handler)
