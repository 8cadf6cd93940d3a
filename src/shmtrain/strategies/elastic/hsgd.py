"""HSGD: hybrid SGD, synchronous inside a group, SEASGD between groups (ShmCaffe
Section III-D, Fig. 4, Table III).

The workers form ``groups`` groups of ``group_size`` consecutive ranks (the paper's
S x A notation: S = group size, A = groups). Inside a group the gradients are averaged
by the shared-memory allreduce (phase ``allreduce``) and every member applies the same
step, so the members' weights stay identical. Every ``update_interval`` iterations the
group's root (its first rank) runs SEASGD against the global weights (eqs. (5)-(7),
Fig. 6: ``wait``, ``rgw``, ``ulw`` here, ``wwi`` and ``ugw`` in its update thread) and
broadcasts the result to its group (``broadcast``): the root's weights live in a
shared segment of the group, which the members copy. The root of group 0 is the
master worker.

The gradients live in the group allreduce's slots as ssgd's do (:class:`SlotGradients`:
``param.grad`` are views of this worker's input slot, re-pointed at the mean after the
allreduce). Staged (GPU parameters): each gradient's copy into the group's input slot
starts from its hook during backward, and the mean goes back into ``param.grad``; the root's weights stay on its GPU
and are copied into the group's segment before the broadcast, from which every member
copies them into its own GPU.

Termination alignment runs among the roots; each root passes its decision to its
members so a group always stops at the same iteration. A group cannot lose a member
(its allreduce needs all of them), so a worker's death ends the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shmtrain.strategies.base import building, register
from shmtrain.strategies.elastic.eq8 import Eq8Metrics
from shmtrain.strategies.elastic.seasgd import ElasticExchange
from shmtrain.strategies.elastic.shared_weights import ElasticConfig, SharedWeightsStrategy
from shmtrain.strategies.parts import SlotGradients


@register
class HSGD(Eq8Metrics, SlotGradients, SharedWeightsStrategy):
    """Synchronous gradient allreduce inside groups, SEASGD between group roots (Fig. 4)."""

    name = "hsgd"
    tolerates_peer_loss = False
    allreduce_phase = "allreduce"

    @dataclass(kw_only=True, slots=True)
    class Config(ElasticConfig):
        #: number of groups A (SEASGD between them)
        groups: int = field(default=1, metadata={"help": "groups A of the SxA layout (SEASGD between groups)"})
        #: workers per group S (allreduce inside); 0 = workers / groups
        group_size: int = field(
            default=0, metadata={"help": "workers per group S (allreduce inside); 0 = workers / groups"}
        )

        def __post_init__(self) -> None:
            ElasticConfig.__post_init__(self)
            if not isinstance(self.groups, int) or self.groups < 1:
                raise ValueError(f"--groups {self.groups!r} must be an integer >= 1 (the A of SxA)")
            if not isinstance(self.group_size, int) or self.group_size < 0:
                raise ValueError(
                    f"--group-size {self.group_size!r} must be an integer >= 1 (the S of SxA), "
                    "or 0 for workers / groups"
                )

    @classmethod
    def check_world(cls, config: HSGD.Config, workers: int, num_nodes: int = 1) -> int:
        """The group size for ``workers`` on ``num_nodes`` hosts; ValueError naming the options."""
        local = workers // max(num_nodes, 1)
        if num_nodes > 1 and config.groups == 1 and config.group_size == 0:
            return local  # across hosts, by default: one group per host (its shared memory)
        size = config.group_size
        if size == 0:
            if workers % config.groups:
                raise ValueError(
                    f"--groups {config.groups} does not divide the {workers} workers; choose "
                    f"--groups and --group-size with groups x group-size = {workers}"
                )
            size = workers // config.groups
        if config.groups * size != workers:
            raise ValueError(
                f"--groups {config.groups} x --group-size {size} = {config.groups * size} must "
                f"equal the number of workers ({workers}); e.g. --groups 2 --group-size "
                f"{max(workers // 2, 1)} for {workers} workers"
            )
        if num_nodes > 1 and local % size:
            raise ValueError(
                f"--group-size {size} does not divide the {local} workers of each host: a group shares "
                f"one host's memory; choose a group size that divides {local} (default: one group per host)"
            )
        return size

    def __init__(self, config, ctx, model, optimizer, timer=None, *, transports=None) -> None:
        super().__init__(config, ctx, model, optimizer, timer, transports=transports)
        self.allreduce = self.transports.group_allreduce(
            self.subgroup, self.layout.numel, self.layout.dtype, op="mean", tag="hsgd.grads"
        )
        self._broadcast = self.transports.channel("hsgd.broadcast")
        self._decision = self.transports.channel("hsgd.decision")
        self.bind_slots()  # the views of the slots, and the staging (its copies' hooks) when staged
        self.exchange = None
        if self.is_root:
            self.exchange = ElasticExchange(
                self.service, self.global_weights, self.weight_increment, self.weights,
                config.moving_rate, self.timer, ctx.timeout, self.staging, self.compressed,
            )
        self._exchanges = 0

    @property
    def updates_global(self) -> bool:  # type: ignore[override]
        """Only the group roots run SEASGD against the global weights."""
        return self.is_root

    def local_weights_storage(self) -> torch.Tensor:
        """The group's weights live in a segment of the group: the root's are the ones
        every member copies (the broadcast of Fig. 4). The group itself is made here, the
        first thing the shared-weights set-up asks of HSGD."""
        planned = building.get()  # the plan this strategy is built from answered it already
        fits = planned is not None and planned.config is self.config and planned.fits(
            self.ctx.world_size, self.ctx.num_nodes)
        size = planned.world if fits else self.check_world(self.config, self.ctx.world_size, self.ctx.num_nodes)
        self.subgroup = self.transports.subgroup(size)  # this worker's group of the host
        self.is_root = self.subgroup.local_rank == 0
        itemsize = torch.empty((), dtype=self.layout.dtype).element_size()
        segment = self.transports.segment("hsgd.weights", self.layout.numel * itemsize, group=self.subgroup)
        self._weights_segment = segment
        shared = segment.tensor(self.layout.dtype, 0, self.layout.numel)
        self.group_weights = shared
        if self.is_root and not self.staged:
            return shared
        return torch.empty(self.layout.numel, dtype=self.layout.dtype, device=self.device)

    def replicas(self) -> range:
        """The members of this worker's group (one host's): the same weights, step by step."""
        first = self.ctx.rank - self.subgroup.local_rank
        return range(first, first + self.subgroup.local_world)

    def rejoin_rank(self) -> int:
        """A rejoining group goes on from its root's iterations, all members alike (their
        decisions are posted per iteration)."""
        return self.ctx.rank - self.subgroup.local_rank

    def zero_grad(self) -> None:
        """The shared-weights order: clear the gradients, then the iteration's exchange."""
        SharedWeightsStrategy.zero_grad(self)

    def clear_gradients(self) -> None:
        self.clear_slots()

    def start_iteration(self) -> None:
        if self.iteration % self.config.update_interval:
            return
        self._exchanges += 1
        gh = self.subgroup
        if self.is_root:
            self.exchange.exchange()
            if gh.local_world > 1:
                if self.staged:  # the members copy the root's weights from the group's segment
                    self.group_weights.copy_(self.weights)
                self.transports.control(gh).post(self._broadcast, 0, self._exchanges)
            return
        with self.timer.phase("broadcast"):
            self.transports.control(gh).wait(
                self._broadcast, [0], self._exchanges, timeout=gh.timeout, what="the group root's weights"
            )
            self.weights.copy_(self.group_weights)

    def after_update(self) -> None:
        super().after_update()
        t = self.timer.current
        self.timer.add("comm", t.get("allreduce", 0.0) + t.get("broadcast", 0.0))

    def should_stop(self) -> bool:
        """The root decides by the policy; its members follow, so a group stops together."""
        gh = self.subgroup
        if self.is_root:
            stop = self.termination.decide(self.iteration, self.target_iterations)
            if gh.local_world > 1:
                self.transports.control(gh).post(self._decision, 0, 2 * self.iteration + int(stop))
            return stop
        if self.termination.stopped:
            return True
        self.transports.control(gh).wait(
            self._decision, [0], 2 * self.iteration, timeout=gh.timeout, what="the group root's decision"
        )
        if self.transports.control(gh).get(self._decision, 0) == 2 * self.iteration + 1:
            self.termination.mark_done(self.iteration)
            return True
        return False

    def finish(self) -> None:
        """The shared-weights finish: the exchange closes before the staging (its update
        thread may still copy through it), in :meth:`close_exchange`."""
        SharedWeightsStrategy.finish(self)

    def drain_exchange(self) -> None:
        if self.exchange is not None:
            self.exchange.drain()

    def close_exchange(self) -> None:
        if self.exchange is not None:
            self.exchange.close()
        if self.staging is not None:  # the members' (the root's exchange closed it already)
            self.staging.close()
