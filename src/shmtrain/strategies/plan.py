"""A strategy's job checked once: the variant its config chooses, the job's shape, the optimizer.

Every route to a running strategy (``shmtrain train``'s launcher, ``shmtrain torchrun``,
:class:`shmtrain.parallel.data_parallel.DataParallel` in a user's loop) goes through
:func:`plan`: it resolves the variant (:meth:`Strategy.choose
<shmtrain.strategies.base.Strategy.choose>`), then checks the hosts, the world and the
optimizer, each once, and returns a :class:`Plan`. The plan travels with the run's
configuration to the workers; a worker whose job has the shape the plan was checked for
builds the strategy from it (:meth:`Plan.build`) and checks nothing again. A strategy
built by hand, without a plan, makes the checks it can in its constructor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shmtrain.strategies.base import Strategy, StrategyConfig, building, get


@dataclass(frozen=True)
class Plan:
    """What runs ``config`` in a job of ``workers`` processes on ``num_nodes`` hosts."""

    #: the class that runs it (the variant the config chose)
    strategy: type[Strategy]
    config: StrategyConfig
    #: the option that chose the class, for messages (``--allreduce nccl``, ``--strategy ssgd``)
    label: str
    workers: int
    num_nodes: int
    #: the optimizer name checked (``--optimizer``, or the optimizer's class name); None: none yet
    optimizer: str | None = None
    #: what the strategy's world check answered (hsgd: its group size)
    world: Any = None

    def fits(self, workers: int, num_nodes: int) -> bool:
        """Whether a job of this shape is the one the plan was checked for."""
        return (self.workers, self.num_nodes) == (workers, num_nodes)

    def covers(self, optimizer: str) -> bool:
        """Whether the optimizer ``optimizer`` (a name, any case) was checked."""
        return self.optimizer is not None and self.optimizer.lower() == optimizer.lower()

    def build(self, ctx: Any, model: Any, optimizer: Any, timer: Any = None, *, transports: Any = None) -> Strategy:
        """The strategy for this worker of ``ctx``'s job (collective, as its constructor)."""
        token = building.set(self)
        try:
            return self.strategy(self.config, ctx, model, optimizer, timer, transports=transports)
        finally:
            building.reset(token)


def plan(name: str, config: StrategyConfig, workers: int, num_nodes: int = 1, *,
         optimizer: str | None = None, grad_clip: float | None = None) -> Plan:
    """Check ``config`` of strategy ``name`` for a job of ``workers`` processes on
    ``num_nodes`` hosts (and ``optimizer``, ``grad_clip`` when given), each rule once, in
    the order a user fixes them; the :class:`Plan` that runs it."""
    cls = get(name)
    if not isinstance(config, cls.Config):
        raise ValueError(f"the config is a {type(config).__qualname__}, but --strategy {name} "
                         f"takes a {cls.Config.__qualname__}")
    if cls.world == "one" and workers != 1:
        raise ValueError(f"--workers {workers}: --strategy {name} runs in one process; "
                         "use --workers 1, or --strategy ssgd for several workers")
    impl, label = cls.choose(config)
    impl.check_hosts(config, num_nodes)  # before the world's arithmetic, whose error would mislead
    world = cls.check_world(config, workers, num_nodes)
    if optimizer is not None:
        impl.check_optimizer(optimizer, label, grad_clip=grad_clip)
    return Plan(impl, config, label, workers, num_nodes, optimizer, world)
