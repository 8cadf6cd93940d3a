"""The strategy interface: hooks around one training step, a registry by name.

A strategy decides how workers share parameters; it never knows which transport
carries its bytes (it asks the fabric through the :class:`ProcessContext`). The
runtime (or the :class:`shmtrain.api.DataParallel` wrapper) calls, per iteration::

    zero_grad() -> before_forward() -> forward -> backward
        (on_gradient_ready(param) as each gradient is accumulated)
    -> after_backward() -> apply_update() -> after_update()

and ``finish()`` once at the end. ``should_stop()`` lets asynchronous strategies end
the loop early (termination alignment).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from shmtrain.fabric.context import ProcessContext
from shmtrain.timing import PhaseTimer


@dataclass(kw_only=True, slots=True)
class StrategyConfig:
    """Options shared by no one: each strategy subclasses this with its own fields."""


class Strategy:
    """Base class; also the behaviour of ``single`` (no communication at all)."""

    name: ClassVar[str] = ""
    Config: ClassVar[type[StrategyConfig]] = StrategyConfig
    #: what the strategy needs of the job: "any" size, or exactly "one" process
    world: ClassVar[str] = "any"
    #: asynchronous strategies: a worker killed during training does not end the others
    tolerates_peer_loss: ClassVar[bool] = False
    #: why the strategy runs on one host only (None: it runs across hosts)
    one_host_reason: ClassVar[str | None] = None

    @classmethod
    def check_hosts(cls, num_nodes: int) -> None:
        """Refuse a job over several hosts when the strategy runs on one (``one_host_reason``)."""
        if cls.one_host_reason and num_nodes > 1:
            raise ValueError(
                f"--strategy {cls.name} runs on one host ({num_nodes} hosts in this job): "
                f"{cls.one_host_reason}"
            )

    @classmethod
    def check_world(cls, config: StrategyConfig, workers: int, num_nodes: int = 1) -> None:
        """Reject a job shape the strategy cannot run (before any worker starts)."""

    @classmethod
    def check_metrics(cls, rows: dict[int, list[dict[str, Any]]]) -> dict[str, Any] | None:
        """Strategy-specific checks of a finished run's metrics rows (rank -> rows), for
        ``summary.json``; None when the strategy has none."""
        return None

    @classmethod
    def describe_metrics(cls, summary: dict[str, Any]) -> list[str]:
        """Lines that ``shmtrain train`` prints about the checks in ``summary``."""
        return []

    def __init__(
        self,
        config: StrategyConfig,
        ctx: ProcessContext,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        timer: PhaseTimer | None = None,
    ) -> None:
        self.check_hosts(ctx.num_nodes)
        self.config = config
        self.ctx = ctx
        self.model = model
        self.optimizer = optimizer
        self.timer = timer or PhaseTimer()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.iteration = 0
        #: iterations this worker is asked to run (set by the training loop; None = no limit)
        self.target_iterations: int | None = None
        self._hooks: list[Any] = []
        if type(self).on_gradient_ready is not Strategy.on_gradient_ready:
            for p in self.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self.on_gradient_ready))

    # -- hooks ------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def before_forward(self) -> None:
        """Called before the forward pass of every iteration."""

    def on_gradient_ready(self, param: torch.Tensor) -> None:
        """Called during backward as each parameter's gradient has been accumulated."""

    def after_backward(self) -> None:
        """Called when backward has finished."""

    def apply_update(self) -> None:
        """Apply the gradients to the weights (the optimizer step by default)."""
        self.optimizer.step()

    def after_update(self) -> None:
        """Called after the update; closes the iteration."""
        self.iteration += 1

    def should_stop(self) -> bool:
        """True when this worker must end its loop now.

        By default: once ``target_iterations`` are done. Asynchronous strategies override
        this with a termination-alignment policy (ShmCaffe Section III-E), which may end
        a worker before or after its own target.
        """
        return self.target_iterations is not None and self.iteration >= self.target_iterations

    def finish(self) -> None:
        """Called once after the last iteration."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


_REGISTRY: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make a strategy selectable by its ``name``."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} has no name")
    if cls.name in _REGISTRY:
        raise ValueError(f"strategy name {cls.name!r} is already registered by {_REGISTRY[cls.name].__qualname__}")
    _REGISTRY[cls.name] = cls
    return cls


def registry() -> dict[str, type[Strategy]]:
    """All strategies by name (importing :mod:`shmtrain.strategies` fills it)."""
    return dict(_REGISTRY)


def get(name: str) -> type[Strategy]:
    if name not in _REGISTRY:
        raise ValueError(
            f"--strategy {name!r} is unknown; choose one of: {', '.join(sorted(_REGISTRY))}"
        )
    return _REGISTRY[name]


def config_fields(cls: type[Strategy]) -> list[dataclasses.Field]:
    return list(dataclasses.fields(cls.Config))


@register
class NoComm(Strategy):
    """No communication at all: every worker trains alone on its shard (the floor that
    the step benchmark compares every strategy against)."""

    name = "nocomm"


@register
class Single(NoComm):
    """One process, plain SGD: the reference every synchronous strategy must equal."""

    name = "single"
    world = "one"
