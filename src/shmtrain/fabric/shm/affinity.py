"""Bind a worker to its share of the cores (``--bind core``).

With 4 workers on 2 cores the scheduler places and migrates processes as it likes, and a
collective's latency then depends on which ranks happen to share a core: the same
256 KiB allreduce took either ~0.1 ms or ~0.3 ms for a whole run, launch by launch
(``shmtrain bench allreduce --procs 4 --bind none``). Binding local rank ``r`` to core
``r mod cores`` (or, with cores to spare, to its own block of ``cores // ranks`` cores)
makes the placement the same on every launch: what MPI launchers do with
``-bind-to core``. Only the cores this process may already use are handed out.
"""

from __future__ import annotations

import os


def allowed_cores() -> list[int]:
    """The cores this process may run on (its affinity mask; all of them where the
    platform has no affinity calls)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


_unbound: list[int] | None = None  # the cores this process could use before bind() narrowed them


def host_cores() -> list[int]:
    """The cores the host's ranks share: this process's before :func:`bind` pinned it to its
    share (what the allreduce's cost model describes), else :func:`allowed_cores`."""
    return list(_unbound) if _unbound is not None else allowed_cores()


def share(local_rank: int, local_world: int, allowed: list[int]) -> list[int]:
    """The cores of ``allowed`` that local rank ``local_rank`` of ``local_world`` gets."""
    n = len(allowed)
    if local_world >= n:
        return [allowed[local_rank % n]]
    per = n // local_world
    return allowed[local_rank * per:(local_rank + 1) * per]


def bind(local_rank: int, local_world: int) -> list[int] | None:
    """Pin this process, every thread it already has (gloo's, torch's) and those it will
    start, to its share of the cores it may use; returns them (None where the platform
    has no affinity calls)."""
    global _unbound
    if not hasattr(os, "sched_setaffinity"):
        return None
    if _unbound is None:
        _unbound = allowed_cores()
    cores = share(local_rank, local_world, _unbound)
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:  # sched_setaffinity(0) would pin the calling thread alone
        try:
            os.sched_setaffinity(tid, cores)
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            pass
    return cores
