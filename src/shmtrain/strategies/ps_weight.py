"""Parameter server with weight averaging (WEIGHT-AVG): SHM-Learn-Dist eq. 2.2.

``w = (1/N_w) * sum_i (w_i - eta * g_i)``: every worker applies its own gradient with
its own optimizer (``w_i - eta * g_i``), then the server (rank 0) averages the workers'
weights element-wise and sends the mean back, every ``average_interval`` iterations.
``average_interval = 1`` is the paper's scheme; a larger interval is local SGD (the
workers drift apart for K steps between averages).

Every worker starts from rank 0's initial weights. With plain SGD, interval 1 and equal
starting weights, eq. 2.2 equals eq. 2.1 (eq. 2.3 with all ``w_i = w``); the two differ
with optimizer state (each worker keeps its own momentum here) or a longer interval.
After the last iteration, if it did not end on an averaging round, ``finish()`` runs one
more round so every worker ends with the same (averaged) weights.

Transports as for :mod:`shmtrain.strategies.ps_grad`: with ``ps_transport="shm"`` each
local worker's ``param.data`` are views into its own slot of one host segment; the host
leader averages the slots into the server buffer, which every worker then copies into
its slot (``broadcast``); among hosts the leaders gather their host means to rank 0 and
rank 0 broadcasts the mean back over gloo. ``ps_transport="gloo"`` uses torch.distributed
``gather`` / ``broadcast`` of every worker's flat weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shmtrain.fabric.flat import FlatLayout
from shmtrain.strategies.base import Strategy, register
from shmtrain.strategies.ps_grad import (
    ParameterServerConfig,
    StarRound,
    average_,
    average_among_hosts,
    broadcast_among_hosts,
    ps_phase,
    require_cpu,
    shared_buffers,
)


@register
class ParameterServerWeight(Strategy):
    """Weight-averaging parameter server, rank 0 the server (eq. 2.2)."""

    name = "ps_weight"

    @dataclass(kw_only=True, slots=True)
    class Config(ParameterServerConfig):
        #: iterations between weight averages: 1 = SHM-Learn-Dist eq. 2.2 every step,
        #: K > 1 = local SGD (each worker takes K own steps, then the weights are averaged)
        average_interval: int = field(default=1, metadata={"help": (
            "iterations between weight averages: 1 = every step (SHM-Learn-Dist eq. 2.2), "
            "K > 1 = local SGD")})

        def __post_init__(self) -> None:
            ParameterServerConfig.__post_init__(self)
            if isinstance(self.average_interval, bool) or not isinstance(self.average_interval, int):
                raise ValueError(
                    f"--average-interval {self.average_interval!r} must be an integer number "
                    "of iterations (1 = average every step, as SHM-Learn-Dist eq. 2.2)"
                )
            if self.average_interval < 1:
                raise ValueError(
                    f"--average-interval {self.average_interval} must be >= 1: it is the number "
                    "of iterations between weight averages; use 1 to average after every step"
                )

    def __init__(self, config, ctx, model, optimizer, timer=None) -> None:
        super().__init__(config, ctx, model, optimizer, timer)
        require_cpu(self.name, self.params)
        self.layout = FlatLayout(self.params)
        numel, dtype = self.layout.numel, self.layout.dtype
        self.rounds = 0
        if config.ps_transport == "shm":
            self._round = StarRound(ctx.host, "ps_weight")
            self._segment, self.slots, self.server = shared_buffers(
                ctx.host, "ps_weight", numel, dtype, self.layout.gather()
            )
            if ctx.num_nodes > 1:
                broadcast_among_hosts(ctx, self.server)
                ctx.host.barrier("ps_weight initial weights")
                self._host_means = [torch.empty(numel, dtype=dtype) for _ in range(ctx.num_nodes)] if ctx.rank == 0 else []
            self.weights = self.slots[ctx.local_rank]
            self.weights.copy_(self.server)
        else:
            self._round = None
            self.weights = torch.empty(numel, dtype=dtype)
            self.layout.gather(out=self.weights)
            dist.broadcast(self.weights, src=0)
            self._gathered = [torch.empty(numel, dtype=dtype) for _ in range(ctx.world_size)] if ctx.rank == 0 else None
        self.layout.bind_data(self.weights, copy=False)

    def after_update(self) -> None:
        """After this worker's own step ``w_i - eta g_i``: average every K iterations."""
        super().after_update()
        if self.iteration % self.config.average_interval == 0:
            self.average()

    def average(self) -> None:
        """One round of eq. 2.2: the server averages every worker's weights; all take the mean."""
        self.rounds += 1
        if self._round is None:
            with ps_phase(self.timer, "gather"):
                dist.gather(self.weights, gather_list=self._gathered, dst=0)
            if self.ctx.rank == 0:
                with ps_phase(self.timer, "average"):
                    average_(self.weights, self._gathered)
            with ps_phase(self.timer, "broadcast"):
                dist.broadcast(self.weights, src=0)
            return
        self._round.arrive()
        if self.ctx.local_rank == 0:
            with ps_phase(self.timer, "gather"):
                self._round.wait_arrivals()
            with ps_phase(self.timer, "average"):
                average_(self.server, self.slots)
            if self.ctx.num_nodes > 1:
                with ps_phase(self.timer, "gather"):
                    average_among_hosts(self.ctx, self.server, self._host_means)
            with ps_phase(self.timer, "broadcast"):
                broadcast_among_hosts(self.ctx, self.server)
                self._round.publish()
        with ps_phase(self.timer, "broadcast"):
            if self.ctx.local_rank != 0:
                self._round.wait_published()
            self.weights.copy_(self.server)

    def finish(self) -> None:
        """End on averaged weights; give the model private copies of them."""
        try:
            if self.iteration % self.config.average_interval:
                self.average()
        finally:
            if self._round is not None:
                self._round.close()
            own = self.weights.clone()
            self.layout.bind_data(own, copy=False)
            self.slots = []
            self.weights = own
            Strategy.finish(self)
