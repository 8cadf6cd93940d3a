"""DDP's gradient buckets averaged through the host's shared memory.

``DistributedDataParallel.register_comm_hook`` is DDP's own extension point: DDP calls
the hook once per gradient bucket, in bucket order on every rank, and waits for the
future it returns at the end of backward. :func:`ddp_comm_hook` averages the bucket with
shmtrain's shared-memory allreduce (:class:`shmtrain.fabric.allreduce.shared.ShmAllreduce`:
split reduction inside a host, PAR-SUM of swCaffe Section V-A; hierarchical over gloo
among the hosts' leaders when the job spans hosts) instead of gloo::

    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, shmtrain.ddp_comm_hook)

With ``state=None`` the hook builds one :class:`ShmHookState` per process on its first
call, from the default process group (whatever launched the job: torchrun, shmtrain's
launcher, ``mp.spawn``); a :class:`ShmHookState` can also be passed as the state.
"""

# No ``from __future__ import annotations``: DDP's register_comm_hook compares the hook's
# annotations with the real dist.GradBucket and Future types, not with strings.
import os
from itertools import count

import torch
import torch.distributed as dist

from shmtrain.fabric.allreduce.shared import ShmAllreduce
from shmtrain.fabric.job import hosts
from shmtrain.fabric.job.context import DEFAULT_TIMEOUT_S, ProcessContext, env_int
from shmtrain.fabric.shm.control import MAX_CHANNELS
from shmtrain.fabric.shm.host import HostGroup

_states = count()  # one store namespace per state built in this process (same order on every rank)


class ShmHookState:
    """The state of :func:`ddp_comm_hook`: this host's workers and one shared-memory
    allreduce per DDP bucket index.

    Buffers are allocated collectively, the first time a bucket index is seen with a
    given size (DDP calls the hook in the same bucket order on every rank); when DDP
    rebuilds its buckets after the first iteration and a bucket index changes size, its
    allreduce is replaced (same channels, sequence numbers continued).

    Args:
        ctx: a shmtrain process context to use (its host and hosts' leaders), e.g. the
            one shmtrain's launcher hands a worker; None joins the job of the default
            process group (collective: every rank builds its state in the same order).
        local_world_size: workers per host (default: ``LOCAL_WORLD_SIZE``, else every
            worker on one host); ranks are laid out host after host, as torchrun does.
        timeout: seconds a worker waits for its peers (default ``SHMTRAIN_TIMEOUT`` or 120).
    """

    def __init__(
        self,
        ctx: ProcessContext | None = None,
        *,
        local_world_size: int | None = None,
        timeout: float | None = None,
    ) -> None:
        self.tag = f"ddp{next(_states)}"
        self.buckets: dict[int, ShmAllreduce] = {}
        self.replaced = 0  # bucket allreduces replaced after DDP rebuilt its buckets
        if ctx is not None:
            if local_world_size is not None:
                raise ValueError("ShmHookState: give ctx or local_world_size, not both "
                                 "(the context already says how many workers share a host)")
            self.host, self.leaders = ctx.host, ctx.leaders
            self.world_size = ctx.world_size
            return
        if not dist.is_initialized():
            raise ValueError("ShmHookState needs torch.distributed's default process group: call "
                             "torch.distributed.init_process_group('gloo') before building DDP")
        if timeout is None:
            timeout = float(os.environ.get("SHMTRAIN_TIMEOUT", DEFAULT_TIMEOUT_S))
        self.host, self.leaders = _join(local_world_size, timeout, self.tag)
        self.world_size = dist.get_world_size()

    def allreduce(self, bucket: dist.GradBucket) -> torch.Tensor:
        """Average ``bucket``'s buffer over every worker of the job; returns the shared result
        (valid until this bucket index is reduced again, i.e. through DDP's end of backward)."""
        buffer = bucket.buffer()
        if buffer.device.type != "cpu":
            raise ValueError(f"shmtrain.ddp_comm_hook reduces CPU tensors through shared memory, but "
                             f"bucket {bucket.index()} is on {buffer.device}; use DDP's default "
                             "(NCCL) allreduce for GPU models")
        if self.world_size == 1 or buffer.numel() == 0:
            return buffer
        reducer = self._reducer(bucket.index(), buffer)
        reducer.input().copy_(buffer.view(-1))
        # DDP copies the future's tensor into the gradients itself (finalize_bucket_dense),
        # so the shared result is handed over as it is: no copy back into the bucket.
        return reducer()

    def _reducer(self, index: int, buffer: torch.Tensor) -> ShmAllreduce:
        reducer = self.buckets.get(index)
        if reducer is not None and reducer.numel == buffer.numel() and reducer.slots[0][0].dtype == buffer.dtype:
            return reducer
        steps = 0
        if reducer is not None:  # DDP rebuilt its buckets: same channels, sequence continued
            steps = reducer.count
            reducer.close()
            self.replaced += 1
        elif self.host.channels_used() + 3 > MAX_CHANNELS:  # ShmAllreduce takes 3 channels
            raise ValueError(
                f"shmtrain.ddp_comm_hook: DDP bucket {index} is one too many for the host's "
                f"{MAX_CHANNELS} control channels (3 per bucket); raise DDP's bucket_cap_mb so the "
                "model has fewer buckets")
        reducer = ShmAllreduce(self.host, buffer.numel(), dtype=buffer.dtype, op="mean",
                               leaders=self.leaders, tag=f"{self.tag}.b{index}")
        reducer.count = steps
        self.buckets[index] = reducer
        return reducer

    def close(self) -> None:
        """Release the shared buffers (DDP must not be stepped with this state afterwards)."""
        for reducer in self.buckets.values():
            reducer.close()
        self.buckets = {}


def _join(local_world_size: int | None, timeout: float, tag: str) -> tuple[HostGroup, dist.ProcessGroup | None]:
    """This worker's host group (and the hosts' leaders' gloo group across hosts), set up
    through the default process group's store under a namespace of its own."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = local_world_size or env_int("LOCAL_WORLD_SIZE", world)
    if local_world < 1 or world % local_world:
        raise ValueError(f"ShmHookState: local_world_size={local_world} must divide the world size "
                         f"{world} (every host runs the same number of workers)")
    node, local_rank = divmod(rank, local_world)
    store = dist.PrefixStore(f"shmtrain-{tag}/", dist.distributed_c10d._get_default_store())
    host = hosts.form_host(store, str(node), local_rank, local_world, hosts.run_id(store, rank), timeout, name=tag)
    leaders = hosts.form_leaders(local_world, world)
    host.barrier("the DDP hook's set-up")
    return host, leaders


_default: "tuple[object, ShmHookState] | None" = None


def default_state() -> ShmHookState:
    """The state ``ddp_comm_hook(None, ...)`` uses: built on first use, one per process and
    default process group (a new default group, after ``destroy_process_group``, gets a new one)."""
    global _default
    group = dist.group.WORLD
    if _default is None or _default[0] is not group:
        _default = (group, ShmHookState())
    return _default[1]


def ddp_comm_hook(state: ShmHookState | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket`` through the host's shared memory.

    ``ddp.register_comm_hook(None, shmtrain.ddp_comm_hook)``; the
    allreduce runs synchronously inside the hook (see docs/collectives.md, "DDP with
    shmtrain's allreduce"), and the future it returns is already complete.

    Args:
        state: a :class:`ShmHookState`, or None for this process's default one.
        bucket: the gradient bucket DDP hands over.

    Returns:
        A completed future holding the bucket averaged over every worker of the job.
    """
    if state is None:
        state = default_state()
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(state.allreduce(bucket))
    return future
