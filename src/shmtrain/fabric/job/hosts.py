"""The one place a host and its leaders' group are formed.

Every route into shared memory needs the same two things: the workers of this host as a
:class:`~shmtrain.fabric.shm.host.HostGroup` (a run id agreed through the store, the
host's keys under ``host<tag>/``, segment names ``shmtrain-<run>-h<tag>[-<name>]``, each
worker's pid in the control block), and, across hosts, a gloo group of the hosts'
leaders (every host's local rank 0) for the hierarchical exchanges (the host's sum,
then the leaders', then back into the host: ShmCaffe's HSGD and swCaffe's hierarchical
allreduce). A worker's context (``fabric/job/context.py``), DDP's comm hook (``parallel/comm_hook.py``)
and the ``shm`` backend (``backend/reducer.py``) are handed what these functions form.
"""

from __future__ import annotations

import os
import secrets
from datetime import timedelta

import torch.distributed as dist

from shmtrain.fabric.shm.control import ControlBlock
from shmtrain.fabric.shm.host import HostGroup
from shmtrain.fabric.shm.segment import PREFIX


def run_id(store: dist.Store, rank: int) -> str:
    """The job's run id (segment names start ``shmtrain-<run id>``): rank 0 draws it
    unless the store already holds one (shmtrain's launcher sets it, so its sweep of the
    prefix finds the segments), every rank reads it."""
    if rank == 0 and not store.check(["run_id"]):
        store.set("run_id", secrets.token_hex(4))
    return store.get("run_id").decode()


def form_host(store: dist.Store, tag: str, local_rank: int, local_world: int, run: str, timeout: float, *,
              name: str = "", control: ControlBlock | None = None) -> HostGroup:
    """This host's workers: keys under ``host<tag>/`` of ``store``, segments named
    ``shmtrain-<run>-h<tag>`` (``-<name>`` after it: a second group of the same job), on
    ``control`` when the launcher made the control block (else one is allocated), this
    worker's pid recorded in it."""
    prefix = f"{PREFIX}-{run}-h{tag}" + (f"-{name}" if name else "")
    host = HostGroup(dist.PrefixStore(f"host{tag}/", store), local_rank, local_world, prefix, control, timeout)
    host.control.set_pid(local_rank, os.getpid())
    return host


def form_leaders(local_world: int, world: int, timeout: float | None = None) -> dist.ProcessGroup | None:
    """The hosts' leaders' gloo group of the default process group (a collective: every
    rank calls it; a rank outside the group gets torch's non-member marker), or None on
    one host."""
    if world <= local_world:
        return None
    ranks = [node * local_world for node in range(world // local_world)]
    if timeout is None:
        return dist.new_group(ranks, backend="gloo")
    return dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout))


def leaders_from_store(store: dist.Store, node: int, hosts: int, timeout: timedelta) -> dist.ProcessGroup:
    """The hosts' leaders' gloo group formed by the leaders alone from ``store`` (keys
    under ``leaders/``; no default process group needed: the ``shm`` backend's own)."""
    return dist.ProcessGroupGloo(dist.PrefixStore("leaders/", store), node, hosts, timeout)
