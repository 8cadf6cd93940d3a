"""The allreduce peers ``shmtrain bench allreduce --peers`` runs beside shmtrain's.

Each peer runs in processes of its own, with its own launcher, on the same host, with
the same process count and sizes, float32 sum in place, and reports per size the median
and p90 of samples that are each the slowest rank's time (a barrier before each):

``gloo``
    ``torch.distributed.all_reduce`` over gloo (measured in shmtrain's own launch).
``mpich``
    MPICH through mpi4py (``comm.Allreduce(MPI.IN_PLACE, ...)``), started with the
    ``mpiexec`` installed beside this Python (``pip install 'shmtrain[peers]'``).
``deepspeed``
    DeepSpeed's CPU shared-memory allreduce (``DS_ACCELERATOR=cpu``,
    ``deepspeed.comm.inference_all_reduce``; it JIT-builds its op with g++ on first
    use), started with torchrun.

A peer that cannot run here (not installed, fails to build, times out) is reported with
the reason instead of figures, and the others go on. A peer that ran is checked before
its figures count (:func:`validate`): every rank fills its buffer with ``rank + 1``, and
each row must come from a world of ``--procs`` ranks whose sum is exactly
``procs * (procs + 1) / 2`` for every size asked. A run that fails is reported invalid
with the reason and never ranked (an mpi4py that loaded another MPI library than the
``mpiexec`` that started it runs ``procs`` singleton worlds: each "allreduces" alone,
instantly, and a check against its own world size passes). Each row also carries the
CPU seconds per call summed over the ranks (``cpu_s``: the process time of every thread,
around the call only; a peer that busy-waits pays for it here).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PEERS = ("gloo", "mpich", "deepspeed")
EXTERNAL = ("mpich", "deepspeed")
TIMEOUT_S = 300.0


def summarize(samples: list[float]) -> dict[str, float]:
    """Median and p90 (nearest rank) of ``samples``, in seconds."""
    ordered = sorted(samples)
    return {"median_s": statistics.median(ordered), "p90_s": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]}


def reps_for(nbytes: int, reps: int) -> int:
    return reps if nbytes <= 64 << 20 else max(3, reps // 2)


def expected_sum(procs: int) -> float:
    """Every element's sum when rank ``r`` fills its buffer with ``r + 1``."""
    return procs * (procs + 1) / 2


def validate(rows: list[dict[str, Any]], procs: int, sizes: list[int]) -> str | None:
    """Why a peer's rows must not count, or None: every size asked has a row, from a
    world of ``procs`` ranks, with the exact sum."""
    seen = {r.get("bytes"): r for r in rows}
    missing = [s for s in sizes if s not in seen]
    if missing:
        return f"invalid: no result for {len(missing)} of the sizes (e.g. {missing[0]} bytes)"
    for size in sizes:
        row = seen[size]
        if row.get("world_size") != procs:
            return (f"invalid: it ran in a world of {row.get('world_size')} ranks, not --procs {procs} "
                    f"(at {size} bytes); for MPICH: mpi4py loaded an MPI library other than the mpiexec "
                    "that started it, so each process ran alone")
        if row.get("correct") is not True:
            return f"invalid: wrong sum at {size} bytes (every element must be {expected_sum(procs):g})"
    return None


# -- inside the peers' processes ---------------------------------------------------------------
def _measure(sizes: list[int], reps: int, make, fill, barrier, run, slowest, total, correct,
             world_size: int) -> list[dict[str, Any]]:
    """The one timing loop of every external peer: per size, 2 warm-up and ``reps``
    timed repetitions after a barrier each, the per-rank times combined by ``slowest``
    once at the end (as shmtrain's ``timed_collective`` does), the CPU seconds per call
    summed over the ranks by ``total``."""
    rows = []
    for nbytes in sizes:
        buf = make(nbytes // 4)
        count = reps_for(nbytes, reps)
        samples, cpu = [], 0.0
        for i in range(2 + count):
            fill(buf)
            barrier()
            cpu_start = time.process_time()
            start = time.perf_counter()
            run(buf)
            elapsed = time.perf_counter() - start
            if i >= 2:
                samples.append(elapsed)
                cpu += time.process_time() - cpu_start
        rows.append({"bytes": nbytes, "correct": correct(buf), **summarize(slowest(samples)), "reps": count,
                     "cpu_s": total(cpu) / count, "world_size": world_size})
    return rows


def _mpich(sizes: list[int], reps: int, procs: int, out: str) -> None:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()

    def slowest(samples: list[float]) -> list[float]:
        times = np.array(samples)
        comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
        return times.tolist()

    rows = _measure(sizes, reps, lambda n: np.ones(n, dtype=np.float32), lambda b: b.fill(rank + 1.0),
                    comm.Barrier, lambda b: comm.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM), slowest,
                    lambda cpu: comm.allreduce(cpu, op=MPI.SUM),
                    lambda b: bool(np.all(b == expected_sum(procs))), comm.Get_size())
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def _deepspeed(sizes: list[int], reps: int, procs: int, out: str) -> None:
    import deepspeed
    import deepspeed.comm as ds_comm
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()

    def slowest(samples: list[float]) -> list[float]:
        times = torch.tensor(samples, dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        return times.tolist()

    def total(cpu: float) -> float:
        summed = torch.tensor([cpu], dtype=torch.float64)
        dist.all_reduce(summed)
        return float(summed)

    rows = _measure(sizes, reps, torch.ones, lambda b: b.fill_(rank + 1.0), dist.barrier,
                    ds_comm.inference_all_reduce, slowest, total,
                    lambda b: bool(torch.all(b == expected_sum(procs))), dist.get_world_size())
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    # every rank done before any tears gloo down (an exit without it aborted a rank at times:
    # "terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()


# -- from the benchmark's process -----------------------------------------------------------------
def _why_not(peer: str) -> str | None:
    import importlib.util

    if peer == "mpich":
        if importlib.util.find_spec("mpi4py") is None:
            return "mpi4py is not installed (pip install 'shmtrain[peers]')"
        if _mpiexec() is None:
            return "no mpiexec beside this Python or on PATH (pip install mpich)"
    if peer == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (pip install 'shmtrain[peers]')"
    return None


def _mpiexec() -> str | None:
    beside = Path(sys.executable).with_name("mpiexec")
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def run_peer(peer: str, procs: int, sizes: list[int], reps: int, timeout: float = TIMEOUT_S,
             bind: bool = False) -> dict[str, Any]:
    """Run one external peer; ``{"rows": [...]}``, or ``{"reason": "..."}`` where it could
    not run or its rows fail :func:`validate` (then also ``"invalid": True`` and the
    rejected ``"rows"``). ``bind``: each rank pinned to its share of the cores, as
    shmtrain's ranks (:mod:`shmtrain.fabric.shm.affinity`)."""
    reason = _why_not(peer)
    if reason:
        return {"reason": reason}
    with tempfile.TemporaryDirectory(prefix="shmtrain-peer-") as tmp:
        out = os.path.join(tmp, "rows.json")
        args = ["-m", "shmtrain.bench.peers", peer, out, str(reps), str(procs), *map(str, sizes)]
        env = dict(os.environ, OMP_NUM_THREADS="1", SHMTRAIN_BIND="core" if bind else "none")
        if peer == "mpich":
            cmd = [_mpiexec(), "-n", str(procs), sys.executable, *args]
        else:
            env.update(DS_ACCELERATOR="cpu", LOCAL_SIZE=str(procs))  # its shm op needs LOCAL_SIZE
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs),
                   "--master-port", str(_free_port()), *args]
        before = _shm_names()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"reason": f"timed out after {timeout:.0f} s"}
        finally:
            for name in _shm_names() - before:  # DeepSpeed leaves its shared-memory files behind
                try:
                    os.unlink(f"/dev/shm/{name}")
                except OSError:
                    pass
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stderr or proc.stdout).strip().splitlines()
            last = next((line for line in reversed(tail) if "Error" in line), tail[-1] if tail else "")
            return {"reason": f"failed (exit {proc.returncode}): {last.strip()[:150]}"}
        rows = json.loads(Path(out).read_text())
    reason = validate(rows, procs, sizes)
    return {"rows": rows} if reason is None else {"reason": reason, "invalid": True, "rows": rows}


def _shm_names() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str]) -> int:
    """``python -m shmtrain.bench.peers PEER OUT REPS PROCS SIZE...`` (inside a peer's launch;
    PROCS: the world size the benchmark started, which the sums are checked against)."""
    peer, out, reps, procs, *sizes = argv
    if os.environ.get("SHMTRAIN_BIND") == "core":  # as shmtrain's own ranks (bench allreduce --bind)
        from shmtrain.fabric.shm.affinity import bind

        # the local rank: MPICH's hydra sets MPI_LOCALRANKID / MPI_LOCALNRANKS, torchrun LOCAL_*
        names = ("MPI_LOCALRANKID", "MPI_LOCALNRANKS") if peer == "mpich" else ("LOCAL_RANK", "LOCAL_WORLD_SIZE")
        if not all(n in os.environ for n in names):
            raise RuntimeError(f"--bind core: the launcher set no {' / '.join(names)}; rerun with --bind none")
        bind(int(os.environ[names[0]]), int(os.environ[names[1]]))
    {"mpich": _mpich, "deepspeed": _deepspeed}[peer]([int(s) for s in sizes], int(reps), int(procs), out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
