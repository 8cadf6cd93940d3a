"""Execute a schedule on one rank's buffer over a real transport.

The schedule is compiled once for a rank (:func:`plan_for`): the per-round sends and
receives, with a scratch buffer for the receives that are reduced. Executing a round
posts all of its sends and receives through :meth:`Transport.exchange`, then adds the
received data into place, so a rank's sends always read the buffer as it was when
the round began.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shmtrain.fabric.allreduce.collectives.algorithms import get_algorithm
from shmtrain.fabric.allreduce.collectives.schedule import RankRound, Topology, plan_for
from shmtrain.fabric.allreduce.collectives.transport import Transport


def scratch_elements(plan: Sequence[RankRound]) -> int:
    """Elements of scratch space the plan's reduced receives need in the busiest round."""
    return max(
        (sum(hi - lo for _, lo, hi, red in rnd.recvs if red) for rnd in plan), default=0
    )


def execute(
    plan: Sequence[RankRound],
    transport: Transport,
    buffer: torch.Tensor,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run ``plan`` on the 1-D ``buffer`` in place (sum); return ``buffer``."""
    need = scratch_elements(plan)
    if scratch is None or scratch.numel() < need:
        scratch = torch.empty(need, dtype=buffer.dtype)
    for rnd in plan:
        sends = [(peer, buffer[lo:hi]) for peer, lo, hi in rnd.sends]
        recvs = []
        reduces = []
        offset = 0
        for peer, lo, hi, reduce in rnd.recvs:
            if reduce:
                landing = scratch[offset : offset + hi - lo]
                offset += hi - lo
                reduces.append((buffer[lo:hi], landing))
            else:
                landing = buffer[lo:hi]
            recvs.append((peer, landing))
        transport.exchange(sends, recvs)
        for target, received in reduces:
            target.add_(received)
    return buffer


def allreduce(
    algorithm: str,
    transport: Transport,
    buffer: torch.Tensor,
    topology: Topology | None = None,
) -> torch.Tensor:
    """Sum ``buffer`` over all ranks of ``transport`` in place with ``algorithm``.

    Compiles the schedule on every call: for repeated calls keep a plan
    (:class:`shmtrain.fabric.allreduce.collectives.reducers.ScheduledAllreduce` does).
    """
    if buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError("allreduce needs a flat (1-D, contiguous) buffer; pack it first")
    topology = topology or Topology.single(transport.world_size)
    if topology.world_size != transport.world_size:
        raise ValueError(
            f"topology has {topology.world_size} ranks, the transport {transport.world_size}"
        )
    rounds = get_algorithm(algorithm)(topology, buffer.numel())
    return execute(plan_for(rounds, transport.rank), transport, buffer)
