"""Measure the allreduce's cost model of this machine once, and cache it.

:func:`machine` returns the :class:`~shmtrain.fabric.allreduce.plan.Machine` that
:func:`~shmtrain.fabric.allreduce.plan.choose` takes: the NUMA nodes and their cores
(from ``/sys/devices/system/node``, restricted to the host's cores: this process's
affinity before ``--bind core`` narrowed it), the shared
cache (``/sys/devices/system/cpu/cpu*/cache``), one core's and all cores' copy bandwidth
(a cache-sized copy timed with one torch thread and with one per core) and the hand-off
latency (two threads passing a word back and forth, spinning and sleeping on a futex). The measurement
takes ~0.1-0.3 s on a quiet machine (seconds on a loaded one); the result is written as JSON beside the compiled path's
library
(:func:`shmtrain.fabric.native.cache_dir`), keyed by the CPU's feature list and the
cores and nodes this process may use, so every later process on the machine only reads
it. ``shmtrain bench allreduce --remeasure`` (or deleting ``machine-*.json`` there)
measures again; ``SHMTRAIN_MACHINE=path.json`` takes a described machine instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch

from shmtrain.fabric import native
from shmtrain.fabric.allreduce.plan import Machine
from shmtrain.fabric.native import cache_dir, features
from shmtrain.fabric.shm.affinity import allowed_cores, host_cores

_SYS = Path("/sys/devices/system")


def _cpulist(text: str) -> list[int]:
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]``."""
    cores: list[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cores += range(int(lo), int(hi or lo) + 1)
    return cores


def numa_nodes(allowed: list[int] | None = None, root: Path = _SYS) -> tuple[tuple[int, ...], ...]:
    """The allowed cores of each NUMA node (one node holding them all where the kernel
    lists none)."""
    allowed = allowed_cores() if allowed is None else allowed
    nodes = []
    for path in sorted((root / "node").glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cores = [c for c in _cpulist((path / "cpulist").read_text()) if c in allowed]
        except (OSError, ValueError):
            continue
        if cores:
            nodes.append(tuple(cores))
    covered = {c for node in nodes for c in node}
    if not nodes or covered != set(allowed):
        return (tuple(allowed),)
    return tuple(nodes)


def shared_cache_bytes(core: int = 0, root: Path = _SYS) -> int:
    """The size of the last-level cache of ``core`` (0 where unknown)."""
    best = (0, 0)
    for index in (root / "cpu" / f"cpu{core}" / "cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip().upper()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        size = int(text.rstrip("KMG") or 0) * scale
        best = max(best, (level, size))
    return best[1]


def _copy_Bps(nbytes: int, threads: int, reps: int = 5) -> float:
    """Bytes read + written per second of one cache-warm copy with ``threads`` torch threads."""
    before = torch.get_num_threads()
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    try:
        torch.set_num_threads(threads)
        dst.copy_(src)
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return 2 * nbytes / max(best, 1e-9)


def handoffs(cores: int) -> tuple[float, float]:
    """``(spinning, sleeping)``: seconds per one-way hand-off of a word between two threads,
    waiting by spinning and by sleeping on the futex (the compiled path's
    ``shm_handoff_s``; spinning needs two cores, else it is the sleeping one). Without the
    compiled path: the sleeping hand-off timed in Python (an upper bound: it includes
    the interpreter's time)."""
    lib = native.library()
    if lib is not None:
        sleeping = lib.shm_handoff_s(100, 0)
        spinning = lib.shm_handoff_s(200, 1) if cores >= 2 else sleeping
        if sleeping > 0 and spinning > 0:  # a busy machine can make spinning the slower
            return min(spinning, sleeping), sleeping
    sleeping = _python_handoff_s()
    return sleeping, sleeping


def _python_handoff_s(rounds: int = 200) -> float:
    from shmtrain.fabric.shm.futex import futex_wait, futex_wake

    word = torch.zeros(2, dtype=torch.int32)
    address = word.data_ptr()
    ping, pong = address, address + 4

    def echo() -> None:
        for i in range(1, rounds + 1):
            while int(word[0]) < i:
                futex_wait(ping, i - 1, 0.01)
            word[1] = i
            futex_wake(pong)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    start = time.perf_counter()
    for i in range(1, rounds + 1):
        word[0] = i
        futex_wake(ping)
        while int(word[1]) < i:
            futex_wait(pong, i - 1, 0.01)
    elapsed = time.perf_counter() - start
    thread.join(5.0)
    return elapsed / rounds / 2


def measure() -> Machine:
    """Measure this machine's parameters (~0.1-0.3 s), on the cores this process may use."""
    cores = allowed_cores()
    cache = shared_cache_bytes(cores[0])
    size = max(1 << 20, min(cache // 4 if cache else 4 << 20, 16 << 20))  # in cache, as the ring is
    spinning, sleeping = handoffs(len(cores))
    # both copies of the same cache-resident bytes: all cores share them out
    return Machine(nodes=numa_nodes(cores), copy_one_Bps=_copy_Bps(size, 1),
                   copy_all_Bps=_copy_Bps(size, len(cores)), handoff_s=spinning,
                   wake_s=sleeping, cache_bytes=cache)


def measure_host() -> Machine:
    """:func:`measure` on the host's cores: here, or where :func:`~shmtrain.fabric.shm.affinity.bind`
    has pinned this process to its share (its torch threads too), in a fresh process
    that may use them all (~1-2 s more, once per machine)."""
    cores = host_cores()
    if sorted(cores) == sorted(allowed_cores()):
        return measure()
    code = (f"import os; os.sched_setaffinity(0, {cores!r}); "
            "from shmtrain.fabric.allreduce import machine_model as m; print(m.to_json(m.measure()))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"measuring the machine in a fresh process failed: {done.stderr.strip()[-300:]}")
    return from_json(done.stdout.strip().splitlines()[-1], "the measuring process's output")


def cache_path() -> Path:
    """Where this machine's measurement is kept."""
    cores = host_cores()
    key = hashlib.sha256((features() + repr(cores) + repr(numa_nodes(cores))).encode()).hexdigest()[:16]
    return cache_dir() / f"machine-{key}.json"


def machine(remeasure: bool = False) -> Machine:
    """This machine's parameters: ``$SHMTRAIN_MACHINE``, else the cached measurement, else
    measured now and cached (``remeasure``: measure and overwrite the cache)."""
    described = os.environ.get("SHMTRAIN_MACHINE")
    if described:
        return from_json(Path(described).read_text(), f"SHMTRAIN_MACHINE={described}")
    path = cache_path()
    if not remeasure:
        try:
            return from_json(path.read_text(), str(path))
        except (OSError, ValueError):
            pass
    found = measure_host()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(to_json(found))
        os.replace(tmp, path)  # concurrent first uses: the last one wins, each complete
    except OSError:
        pass  # a read-only cache: measure again next time
    return found


def to_json(m: Machine) -> str:
    return json.dumps(asdict(m))


def from_json(text: str, where: str = "machine description") -> Machine:
    """A :class:`Machine` from :func:`to_json`'s text; ValueError naming ``where`` if malformed."""
    try:
        data = json.loads(text)
        data["nodes"] = tuple(tuple(int(c) for c in node) for node in data["nodes"])
        return Machine(**data)
    except (TypeError, KeyError, ValueError) as exc:
        raise ValueError(f"{where}: not a machine description ({exc}); expected JSON with nodes, "
                         "copy_one_Bps, copy_all_Bps, handoff_s, wake_s, cache_bytes") from exc
