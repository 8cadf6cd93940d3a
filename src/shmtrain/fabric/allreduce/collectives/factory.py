"""``build_allreduce``: the allreduce named by ``--allreduce`` (the factory behind it).

It sits above :mod:`.reducers` (the schedule and gloo reducers) and :mod:`.autotune`
(AUTOTUNE, which tries reducers), so neither of those imports the other's user.
"""

from __future__ import annotations

import torch

from shmtrain.fabric.allreduce.collectives.autotune import AutotunedAllreduce, default_candidates
from shmtrain.fabric.allreduce.collectives.reducers import (
    GlooAllreduce,
    Op,
    ScheduledAllreduce,
    check_name,
    host_topology,
)
from shmtrain.fabric.allreduce.collectives.transport import GlooTransport
from shmtrain.fabric.allreduce.shared import ShmAllreduce


def build_allreduce(
    name: str,
    ctx,
    numel: int,
    dtype: torch.dtype = torch.float32,
    op: Op = "mean",
    *,
    candidates: tuple[str, ...] | None = None,
    trials: int = 2,
    tag: str = "collective",
):
    """The allreduce called ``name`` (a value of ``--allreduce``) for this job.

    ``shm``: :class:`ShmAllreduce` (shared memory inside a host, gloo among hosts);
    ``gloo``: ``dist.all_reduce``; ``ring``/``rhd``/``tree``/``topo``/``hierarchical``:
    the schedule over gloo point-to-point, with groups = hosts; ``auto``: AUTOTUNE
    (:class:`shmtrain.fabric.allreduce.collectives.autotune.AutotunedAllreduce`) over
    ``candidates`` (default: every choice that differs on this job), ``trials`` each.
    Collective: every rank of the job calls it with the same arguments.
    """
    check_name(name)
    if name == "shm":
        return ShmAllreduce(
            ctx.host, numel, dtype=dtype, op=op, leaders=ctx.leaders, tag=f"{tag}.shm"
        )
    if name == "gloo":
        return GlooAllreduce(numel, dtype, op=op)
    if name == "auto":
        names = tuple(candidates) if candidates else default_candidates(ctx)
        for candidate in names:
            if candidate == "auto":
                raise ValueError("--allreduce auto cannot be its own candidate")
            check_name(candidate)
        return AutotunedAllreduce(ctx, numel, dtype, op, names, trials=trials, tag=tag)
    transport = GlooTransport(timeout=ctx.timeout)
    return ScheduledAllreduce(name, transport, numel, dtype, op=op, topology=host_topology(ctx))
