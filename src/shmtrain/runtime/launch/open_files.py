"""The open-file limit (``ulimit -n``) a job across processes needs, checked before it starts.

A torchrun job's processes each hold a socket to every peer in each gloo group, the job's
store connections, the shared segments they map and the data loaders' pipes; a limit
below that fails far from its cause (a socket that cannot be made reads as a peer that
cannot be reached: "could not connect ... within 120 s"). :func:`ensure_open_files`
raises the soft limit to what the job needs when the hard limit allows it, and otherwise
refuses the job in one line that names the limit and the fix.
"""

from __future__ import annotations

import resource

#: descriptors a process needs whatever its job (torch, the store, segments, loaders)
BASE = 256
#: and per worker of the job (its gloo sockets and connections)
PER_WORKER = 8


def needed(workers: int) -> int:
    """Open files one process of a job of ``workers`` workers needs, at least."""
    return BASE + PER_WORKER * max(1, workers)


def ensure_open_files(workers: int, what: str) -> int:
    """This process's soft open-file limit after making it at least :func:`needed`
    (raised up to the hard limit; inherited by the processes it starts).

    Raises:
        ValueError: the hard limit is below the need (names both and the fix).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = needed(workers)
    if soft >= need:
        return soft
    if hard == resource.RLIM_INFINITY or hard >= need:
        target = need if hard == resource.RLIM_INFINITY else min(hard, max(need, 4096))
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    raise ValueError(
        f"{what}: the open-file limit (ulimit -n) is {soft} here, hard limit {hard}; a job of {workers} "
        f"workers needs about {need} open files per process (gloo's sockets to every peer, the job's store, "
        "the shared-memory segments, the data loaders' pipes); raise it before starting, e.g. ulimit -n 4096 "
        "(a hard limit that low is set for you: /etc/security/limits.conf, or a container's --ulimit nofile=)")
