"""Allreduce objects for training, with the interface of :class:`ShmAllreduce`.

``input(step)`` is the flat buffer the gradients of ``step`` are written to (default:
the next call), ``__call__()`` reduces it and returns the result, ``result(step)``
returns it again, ``count`` counts calls. Two buffers alternate by step parity, like
the shared-memory allreduce, so the strategy can bind its views once. The schedule
algorithms reduce in place, so ``result(s)`` is ``input(s)``.

:func:`shmtrain.fabric.allreduce.collectives.factory.build_allreduce` is the factory behind
``--allreduce``.
"""

from __future__ import annotations

import typing
from typing import Literal

import torch
import torch.distributed as dist

from shmtrain.fabric.allreduce.collectives.algorithms import ALGORITHMS, get_algorithm
from shmtrain.fabric.allreduce.collectives.executor import execute, scratch_elements
from shmtrain.fabric.allreduce.collectives.schedule import Topology, plan_for
from shmtrain.fabric.allreduce.collectives.transport import Transport

#: every value of ``--allreduce``
AllreduceChoice = Literal["shm", "gloo", "ring", "rhd", "tree", "topo", "hierarchical", "auto"]
CHOICES: tuple[str, ...] = typing.get_args(AllreduceChoice)
assert set(CHOICES) == {"shm", "gloo", "auto", *ALGORITHMS}, "AllreduceChoice must name every algorithm"

Op = Literal["mean", "sum"]


class TwoBuffers:
    """Two alternating flat buffers reduced in place; subclasses implement ``_sum``."""

    def __init__(
        self,
        numel: int,
        dtype: torch.dtype,
        op: Op,
        world_size: int,
        buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        if op not in ("mean", "sum"):
            raise ValueError(f"op {op!r} must be 'mean' or 'sum'")
        self.numel = numel
        self.op = op
        self.world_size = world_size
        self.buffers = buffers or (torch.zeros(numel, dtype=dtype), torch.zeros(numel, dtype=dtype))
        self.count = 0

    def input(self, step: int | None = None) -> torch.Tensor:
        """The buffer to write the input of ``step`` into (default: the next call)."""
        step = self.count + 1 if step is None else step
        return self.buffers[step % 2]

    def result(self, step: int | None = None) -> torch.Tensor:
        """The result of ``step`` (default: the last call); the same tensor as its input."""
        step = self.count if step is None else step
        return self.buffers[step % 2]

    def __call__(self) -> torch.Tensor:
        """Reduce the buffer of the next step over every rank; return it."""
        self.count += 1
        return self.reduce_step(self.count)

    def reduce_step(self, step: int) -> torch.Tensor:
        buffer = self.buffers[step % 2]
        self._sum(buffer)
        if self.op == "mean" and self.world_size > 1:
            buffer.div_(self.world_size)
        return buffer

    def _sum(self, buffer: torch.Tensor) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Nothing to release (the buffers are ordinary tensors); for symmetry with shm."""


class ScheduledAllreduce(TwoBuffers):
    """A schedule algorithm (ring, rhd, tree, topo, hierarchical) over a transport.

    Args:
        algorithm: a name of :data:`ALGORITHMS`.
        transport: this rank's point-to-point transport.
        numel, dtype: the flat buffer.
        op: ``"mean"`` over the transport's ranks, or ``"sum"``.
        topology: groups of ranks (topo and hierarchical use them); one group if omitted.
        buffers: two buffers to reduce in place instead of fresh ones.
    """

    def __init__(
        self,
        algorithm: str,
        transport: Transport,
        numel: int,
        dtype: torch.dtype = torch.float32,
        *,
        op: Op = "mean",
        topology: Topology | None = None,
        buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        super().__init__(numel, dtype, op, transport.world_size, buffers)
        self.algorithm = algorithm
        self.transport = transport
        self.topology = topology or Topology.single(transport.world_size)
        if self.topology.world_size != transport.world_size:
            raise ValueError(
                f"topology has {self.topology.world_size} ranks, the job {transport.world_size}"
            )
        rounds = get_algorithm(algorithm)(self.topology, numel)
        self.plan = plan_for(rounds, transport.rank)
        self.scratch = torch.empty(scratch_elements(self.plan), dtype=dtype)

    def _sum(self, buffer: torch.Tensor) -> None:
        execute(self.plan, self.transport, buffer, self.scratch)


class GlooAllreduce(TwoBuffers):
    """torch.distributed's own ``all_reduce`` (gloo on CPU), for comparison."""

    def __init__(
        self,
        numel: int,
        dtype: torch.dtype = torch.float32,
        *,
        op: Op = "mean",
        group: dist.ProcessGroup | None = None,
        buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        super().__init__(numel, dtype, op, dist.get_world_size(group), buffers)
        self.group = group

    def _sum(self, buffer: torch.Tensor) -> None:
        if self.world_size > 1:
            dist.all_reduce(buffer, group=self.group)


def host_topology(ctx) -> Topology:
    """Groups = hosts: ranks ``[h*L, (h+1)*L)`` are host ``h`` (torchrun's numbering)."""
    return Topology.uniform(ctx.world_size, ctx.local_world)


def check_name(name: str) -> str:
    if name not in CHOICES:
        raise ValueError(
            f"--allreduce {name!r} is not an allreduce algorithm; choose one of "
            f"{', '.join(CHOICES)}"
        )
    return name
