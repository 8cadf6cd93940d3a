"""``shmtrain bench ops``: every collective of the ``cpu:shm`` backend beside gloo and MPICH.

For each process count and size, in one run: each op through ``torch.distributed`` on
``cpu:shm`` (the default group) and on a gloo group of the same processes, the two
interleaved repetition by repetition; then MPICH through mpi4py (numpy buffers, started
with the ``mpiexec`` beside this Python: ``pip install mpi4py mpich``) with the same ops and
sizes. Each sample is the slowest rank's time of one call after a barrier (``--streak N``:
of N calls in a row after it, per call: what calls issued back to back cost, as a training
loop issues them, rather than a lone call's latency, wake-ups included); the table shows
medians. Every result of every peer is checked against its definition (float32 inputs
filled by rank; a peer whose check fails is reported invalid and not ranked):

- ``all_reduce`` SUM and MAX: ``P (P + 1) / 2`` and ``P`` everywhere (rank r holds r + 1);
- ``broadcast``: the root's 1.0 everywhere;
- ``all_gather_into_tensor``: piece r of the output is r + 1;
- ``reduce_scatter_tensor`` SUM: ``P (P + 1) / 2``;
- ``all_to_all_single``: rank r's piece from rank i is ``i P + r``.

The size is each rank's input in bytes (all_gather's output is P times it; reduce_scatter's
input is P times its output: MPICH's ``Reduce_scatter_block`` and ``Allgather`` alike).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

OPS = ("all_reduce", "all_reduce_max", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
       "all_to_all_single")


def reps_for(nbytes: int, reps: int) -> int:
    return reps if nbytes <= 1 << 20 else max(3, reps // 4) if nbytes <= 64 << 20 else 3


def _expected(op: str, procs: int, rank: int, n: int) -> Any:
    """What rank ``rank``'s output must hold (numpy), for :func:`_check`."""
    import numpy as np

    total = procs * (procs + 1) / 2
    if op == "all_reduce":
        return np.full(n, total, dtype=np.float32)
    if op == "all_reduce_max":
        return np.full(n, procs, dtype=np.float32)
    if op == "broadcast":
        return np.ones(n, dtype=np.float32)
    if op == "all_gather_into_tensor":
        return np.repeat(np.arange(1, procs + 1, dtype=np.float32), n)
    if op == "reduce_scatter_tensor":
        return np.full(n, total, dtype=np.float32)
    return np.repeat(np.arange(procs, dtype=np.float32) * procs + rank, n // procs)


def _buffers(op: str, procs: int, rank: int, n: int, xp: Any) -> tuple[Any, Any]:
    """(input, output) of ``n`` float32 elements a rank (``xp``: numpy or torch)."""
    f32 = xp.float32
    if op in ("all_reduce", "all_reduce_max"):
        buf = xp.full((n,), float(rank + 1), dtype=f32)
        return buf, buf
    if op == "broadcast":
        buf = xp.full((n,), 1.0 if rank == 0 else 0.0, dtype=f32)
        return buf, buf
    if op == "all_gather_into_tensor":
        return xp.full((n,), float(rank + 1), dtype=f32), xp.zeros((procs * n,), dtype=f32)
    if op == "reduce_scatter_tensor":
        return xp.full((procs * n,), float(rank + 1), dtype=f32), xp.zeros((n,), dtype=f32)
    per = n // procs
    send = xp.zeros((per * procs,), dtype=f32)
    for j in range(procs):
        send[j * per:(j + 1) * per] = rank * procs + j
    return send, xp.zeros((per * procs,), dtype=f32)


def _summary(samples: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(samples), "min_s": min(samples)}


# -- torch.distributed: shm and gloo in the same processes -------------------------------------
def _torch_rank(rank: int, procs: int, port: int, sizes: list[int], ops: list[str], reps: int, out: str,
                streak: int = 1) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    import shmtrain  # noqa: F401 - registers the "shm" backend
    from shmtrain.backend import ShmBackend

    dist.init_process_group("cpu:shm", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=procs,
                            timeout=timedelta(seconds=300))
    groups = {"shm": None, "gloo": dist.new_group(backend="gloo")}
    rows = []
    for op in ops:
        for nbytes in sizes:
            n = max(procs, nbytes // 4 // procs * procs)
            count = reps_for(nbytes, reps)
            samples: dict[str, list[float]] = {impl: [] for impl in groups}
            correct = dict.fromkeys(groups, True)
            for i in range(2 + count):
                for impl, group in groups.items():
                    inp, outp = _buffers(op, procs, rank, n, torch)
                    call = _torch_call(op, inp, outp, group, dist)
                    calls = 1 if i == 0 else streak  # the first call alone: its result is checked
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(calls):
                        call()
                    elapsed = (time.perf_counter() - start) / calls
                    if i >= 2:
                        samples[impl].append(elapsed)
                    if i == 0:
                        correct[impl] = bool(np.array_equal(outp.numpy(), _expected(op, procs, rank, n)))
            for impl in groups:
                times = torch.tensor(samples[impl], dtype=torch.float64)
                dist.all_reduce(times, op=dist.ReduceOp.MAX)
                ok = torch.tensor([int(correct[impl])])
                dist.all_reduce(ok, op=dist.ReduceOp.MIN)
                rows.append({"impl": impl, "op": op, "procs": procs, "bytes": nbytes, "reps": count,
                             "streak": streak, "correct": bool(ok), **_summary(times.tolist())})
    if rank == 0:
        rows.append({"impl": "shm", "through_gloo": dict(ShmBackend.through_gloo),
                     "through_shm": dict(ShmBackend.through_shm)})
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def _torch_call(op: str, inp: Any, outp: Any, group: Any, dist: Any) -> Any:
    if op == "all_reduce":
        return lambda: dist.all_reduce(inp, group=group)
    if op == "all_reduce_max":
        return lambda: dist.all_reduce(inp, op=dist.ReduceOp.MAX, group=group)
    if op == "broadcast":
        return lambda: dist.broadcast(inp, src=0, group=group)
    if op == "all_gather_into_tensor":
        return lambda: dist.all_gather_into_tensor(outp, inp, group=group)
    if op == "reduce_scatter_tensor":
        return lambda: dist.reduce_scatter_tensor(outp, inp, group=group)
    return lambda: dist.all_to_all_single(outp, inp, group=group)


# -- MPICH -----------------------------------------------------------------------------------------
def _mpich_rank(sizes: list[int], ops: list[str], reps: int, out: str, streak: int = 1) -> None:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, procs = comm.Get_rank(), comm.Get_size()
    rows = []
    for op in ops:
        for nbytes in sizes:
            n = max(procs, nbytes // 4 // procs * procs)
            count = reps_for(nbytes, reps)
            samples, correct = [], True
            for i in range(2 + count):
                inp, outp = _buffers(op, procs, rank, n, np)
                call = _mpi_call(op, inp, outp, comm, MPI)
                calls = 1 if i == 0 else streak
                comm.Barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                elapsed = (time.perf_counter() - start) / calls
                if i >= 2:
                    samples.append(elapsed)
                if i == 0:
                    correct = bool(np.array_equal(outp, _expected(op, procs, rank, n)))
            times = np.array(samples)
            comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
            ok = comm.allreduce(int(correct), op=MPI.MIN)
            rows.append({"impl": "mpich", "op": op, "procs": procs, "bytes": nbytes, "reps": count,
                         "streak": streak, "correct": bool(ok), **_summary(times.tolist())})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def _mpi_call(op: str, inp: Any, outp: Any, comm: Any, MPI: Any) -> Any:  # noqa: N803 - mpi4py's module
    if op == "all_reduce":
        return lambda: comm.Allreduce(MPI.IN_PLACE, inp, op=MPI.SUM)
    if op == "all_reduce_max":
        return lambda: comm.Allreduce(MPI.IN_PLACE, inp, op=MPI.MAX)
    if op == "broadcast":
        return lambda: comm.Bcast(inp, root=0)
    if op == "all_gather_into_tensor":
        return lambda: comm.Allgather(inp, outp)
    if op == "reduce_scatter_tensor":
        return lambda: comm.Reduce_scatter_block(inp, outp, op=MPI.SUM)
    return lambda: comm.Alltoall(inp, outp)


# -- from the benchmark's process ------------------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mpiexec() -> str | None:
    import shutil

    beside = Path(sys.executable).with_name("mpiexec")
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def run(procs_list: list[int], sizes: list[int], ops: list[str], reps: int, peers: list[str],
        streak: int = 1) -> list[dict]:
    """Every row (shm, gloo, then each peer), each checked (``correct``; a peer's failure
    to run is a row with its ``reason``); ``streak``: calls timed in a row per sample."""
    rows: list[dict] = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="shmtrain-bench-ops-") as tmp:
        for procs in procs_list:
            out = os.path.join(tmp, f"torch-{procs}.json")
            port = _free_port()
            args = ["--sizes", *map(str, sizes), "--ops", *ops, "--reps", str(reps), "--streak", str(streak),
                    "--out", out]
            ranks = [subprocess.Popen([sys.executable, "-m", "shmtrain.bench.ops", "torch", str(r), str(procs),
                                       str(port), *args], env=env) for r in range(procs)]
            codes = [p.wait(timeout=3600) for p in ranks]
            if any(codes):
                raise RuntimeError(f"bench ops: the {procs} ranks on shm and gloo failed (exit codes {codes})")
            rows += json.loads(Path(out).read_text())
            if "mpich" in peers:
                rows += _run_mpich(procs, args, out.replace("torch", "mpich"), env)
    return rows


def _run_mpich(procs: int, args: list[str], out: str, env: dict[str, str]) -> list[dict]:
    import importlib.util

    mpiexec = _mpiexec()
    if importlib.util.find_spec("mpi4py") is None or mpiexec is None:
        return [{"impl": "mpich", "procs": procs, "reason": "mpi4py or mpiexec is not installed "
                 "(pip install mpi4py mpich)"}]
    args = [*args[:-1], out]
    proc = subprocess.run([mpiexec, "-n", str(procs), sys.executable, "-m", "shmtrain.bench.ops", "mpich", *args],
                          env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0 or not os.path.exists(out):
        return [{"impl": "mpich", "procs": procs, "reason": f"failed (exit {proc.returncode}): "
                 f"{(proc.stderr or proc.stdout).strip()[-200:]}"}]
    rows = json.loads(Path(out).read_text())
    if any(r.get("procs") != procs for r in rows):  # an mpi4py of another MPI runs singleton worlds
        return [{"impl": "mpich", "procs": procs, "reason": "invalid: it ran in a world other than --procs"}]
    return rows


def table(rows: list[dict]) -> str:
    """Median ms per op, size and process count: shm / gloo / mpich, and shm's ratio to the
    faster of gloo and MPICH (an invalid peer's figure is shown as ``invalid``)."""
    timed = {(r["impl"], r["op"], r["procs"], r["bytes"]): r for r in rows if "median_s" in r}
    keys = sorted({(op, p, b) for _, op, p, b in timed}, key=lambda k: (k[1], OPS.index(k[0]), k[2]))
    lines = ["| op | procs | bytes | shm ms | gloo ms | mpich ms | shm / best peer |", "|---|---|---|---|---|---|---|"]
    for op, p, b in keys:
        cells, peers = [], []
        for impl in ("shm", "gloo", "mpich"):
            row = timed.get((impl, op, p, b))
            if row is None:
                cells.append("-")
            elif not row["correct"]:
                cells.append("invalid")
            else:
                cells.append(f"{row['median_s'] * 1e3:.3f}")
                if impl != "shm":
                    peers.append(row["median_s"])
        shm = timed.get(("shm", op, p, b))
        ratio = f"{shm['median_s'] / min(peers):.2f}" if shm and shm["correct"] and peers else "-"
        lines.append(f"| {op} | {p} | {_size(b)} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def add_parser(sub: argparse._SubParsersAction) -> None:
    from shmtrain.bench.common import parse_size

    p = sub.add_parser("ops", help="every collective: cpu:shm vs gloo vs MPICH",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", type=int, nargs="+", default=[2, 4], help="process counts (default 2 4)")
    p.add_argument("--sizes", nargs="+", default=["4KiB", "64KiB", "1MiB", "16MiB"],
                   help="bytes per rank (default 4KiB 64KiB 1MiB 16MiB)")
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS, help="ops (default all)")
    p.add_argument("--reps", type=int, default=20, help="timed calls at small sizes (fewer above 1 MiB)")
    p.add_argument("--peers", nargs="*", default=["mpich"], choices=["mpich"], help="peers beside gloo")
    p.add_argument("--streak", type=int, default=1,
                   help="calls timed in a row per sample, per call (default 1: a lone call after a barrier)")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.set_defaults(handler=lambda a: _main([parse_size(s) for s in a.sizes], a))


def _main(sizes: list[int], args: argparse.Namespace) -> int:
    if any(p < 2 for p in args.procs):
        raise ValueError(f"--procs {args.procs}: every count must be at least 2; e.g. --procs 2 4")
    if args.streak < 1:
        raise ValueError(f"--streak {args.streak}: at least 1 call per sample; e.g. --streak 20")
    rows = run(args.procs, sizes, args.ops, args.reps, args.peers, args.streak)
    print(table(rows))
    for row in rows:
        if "reason" in row:
            print(f"{row['impl']} at {row['procs']} processes: {row['reason']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    which, *rest = sys.argv[1:]
    parser = argparse.ArgumentParser()
    if which == "torch":
        rank, procs, port, *rest = rest
    parser.add_argument("--sizes", type=int, nargs="+", required=True)
    parser.add_argument("--ops", nargs="+", required=True)
    parser.add_argument("--reps", type=int, required=True)
    parser.add_argument("--streak", type=int, default=1)
    parser.add_argument("--out", required=True)
    a = parser.parse_args(rest)
    if which == "torch":
        _torch_rank(int(rank), int(procs), int(port), a.sizes, a.ops, a.reps, a.out, a.streak)
    else:
        _mpich_rank(a.sizes, a.ops, a.reps, a.out, a.streak)
