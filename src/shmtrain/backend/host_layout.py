"""Where a rank of a ``shm`` group sits: its host, its local rank, and whether its group's
calls run on the caller's thread (the host's cores against its ranks' threads)."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from shmtrain.fabric.shm.affinity import allowed_cores


def layout(store: dist.Store, rank: int, size: int, name: str) -> tuple[int, int, int]:
    """``(node, local_rank, local_world)`` of this rank: torchrun's LOCAL_WORLD_SIZE when it
    divides the world, else from the host names in the store (ranks of a host contiguous)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if not (local_world and size % local_world == 0 and int(os.environ.get("WORLD_SIZE", size)) == size):
        store.set(f"host/{rank}", socket.gethostname())
        names = [store.get(f"host/{r}").decode() for r in range(size)]
        local_world = names.count(names[0])
        if any(names[r] != names[(r // local_world) * local_world] for r in range(size)) or size % local_world:
            raise ValueError(f"backend {name!r}: ranks must be laid out host after host with the same number "
                             f"on every host (host names by rank: {names}); set LOCAL_WORLD_SIZE or use gloo")
    node, local_rank = divmod(rank, local_world)
    return node, local_rank, local_world


def inline(local_world: int) -> bool:
    """Whether allreduce runs on the caller's thread: when the host has no core to spare
    for a reduction thread beside every rank's torch threads (2 workers on 2 cores: the
    thread only time-shares the backward pass's core, and its hand-offs add wake-ups;
    measured in docs/collectives.md). ``SHMTRAIN_PG_THREAD=1`` or ``0`` decides instead."""
    forced = os.environ.get("SHMTRAIN_PG_THREAD", "")
    if forced in ("0", "1"):
        return forced == "0"
    return len(allowed_cores()) < local_world * (torch.get_num_threads() + 1)


__all__ = ["inline", "layout"]
