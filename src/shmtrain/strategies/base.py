"""The strategy interface: hooks around one training step, a registry by name.

A strategy decides how workers share parameters; it never knows which transport
carries its bytes (it asks the fabric through the :class:`ProcessContext`). The
runtime (or the :class:`shmtrain.parallel.data_parallel.DataParallel` wrapper) calls, per iteration::

    zero_grad() -> before_forward() -> forward -> backward
        (on_gradient_ready(param) as each gradient is accumulated)
    -> after_backward() -> apply_update() -> after_update()

and ``finish()`` once at the end. ``should_stop()`` lets asynchronous strategies end
the loop early (termination alignment).

Three seams (docs/architecture.md):

- **Transport**: a strategy gets its allreduce, bucket reducer, buffer service and star
  exchange from the :class:`shmtrain.fabric.transports.Transports` it is handed (built
  from the context when none is passed), and the host's segments, control-block words
  and barriers too (never ``ctx.host``); ``hosts_reason(config)`` says, from the
  transport the config chooses, whether the job may span hosts.
- **State**: ``state_dict()`` / ``load_state_dict()`` hold what the strategy adds to the
  model's and optimizer's state (iteration counters, buffers it owns); ``quiesce()``
  drains exchanges still in flight so the state is consistent. ``iteration`` counts the
  run's iterations (restored by ``load_state_dict``); ``steps`` counts the exchanges of
  this process (it starts at 0 with the fabric's fresh sequence words, and protocols
  number their rounds with it).
- **Device**: ``devices`` lists the parameter devices the strategy supports (cpu and
  cuda for every strategy); the base constructor refuses others with one message. The
  buffers stay in host memory; copies between a device and them go through
  :class:`shmtrain.strategies.layout.staging.HostStaging` (``self.staged`` says whether the
  strategy copies: on a GPU, or with ``SHMTRAIN_STAGING=copy`` on the CPU).
  ``step_optimizer`` runs the optimizer through a GradScaler when one is attached
  (``--amp fp16``), ``fp16`` says whether the strategy supports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from shmtrain.fabric.job.context import ProcessContext
from shmtrain.fabric.transports import Transports
from shmtrain.registry import Registry
from shmtrain.strategies.layout.flat import FlatLayout
from shmtrain.strategies.layout.staging import HostStaging, staged
from shmtrain.strategies.optim.grad_safety import writes_gradients
from shmtrain.strategies.recovery_hooks import RecoveryHooks
from shmtrain.timing import PhaseTimer


@dataclass(kw_only=True, slots=True)
class StrategyConfig:
    """Options shared by no one: each strategy subclasses this with its own fields."""


class Strategy(RecoveryHooks):
    """Base class; also the behaviour of ``single`` (no communication at all)."""

    name: ClassVar[str] = ""
    Config: ClassVar[type[StrategyConfig]] = StrategyConfig
    #: what the strategy needs of the job: "any" size, or exactly "one" process
    world: ClassVar[str] = "any"
    #: asynchronous strategies: a worker killed during training does not end the others
    tolerates_peer_loss: ClassVar[bool] = False
    #: across hosts: the loss of a whole host (its workers) does not end the others (the
    #: strategies whose hosts meet only at a memory server); torchrun's agent ends every
    #: worker of a host once one of them dies, so one worker lost is its host lost
    tolerates_host_loss: ClassVar[bool] = False
    #: across hosts: a lost host started again rejoins the running job (README, "Rejoining";
    #: it has no job-wide gloo group: the strategies whose hosts meet at a memory server)
    rejoins: ClassVar[bool] = False
    #: parameter devices the strategy supports (its buffers' staging, ``strategies/layout/staging.py``)
    devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    #: why ``--amp fp16`` (a GradScaler) cannot run with this strategy; None: it can
    fp16_reason: ClassVar[str | None] = None
    #: ``--optimizer`` names the strategy can step with (None: any torch.optim class)
    optimizers: ClassVar[frozenset[str] | None] = None
    #: why ``--grad-clip`` cannot run with this strategy; None: it can
    grad_clip_reason: ClassVar[str | None] = None
    #: every rank steps on the job's mean gradient each iteration, so the weights stay
    #: equal to DDP's (ssgd and its variants, gpi, cpu_acc, ps_grad): ``DataParallel``
    #: runs ``after_backward`` when backward returns, as DDP averages in backward
    synchronous: ClassVar[bool] = False
    #: unstaged, ``param.grad`` after ``after_backward`` may be views of memory other ranks
    #: read (a slot, a shared sum): ``DataParallel`` hands the user private copies
    shared_gradients: ClassVar[bool] = True
    #: for a GPU-only implementation: what it does with GPUs and how to run it instead
    device_rule: ClassVar[str] = "runs on GPUs only"
    device_fix: ClassVar[str] = "use --device cuda"

    @classmethod
    def choose(cls, config: StrategyConfig) -> tuple[type[Strategy], str]:
        """The class that runs ``config`` (a strategy may hand a variant to another class)
        and the option that chose it, for messages (a variant's own flag, e.g.
        ``--allreduce nccl``; else ``--strategy NAME``). Resolved once per job by
        :func:`shmtrain.strategies.plan.plan`."""
        return cls, f"--strategy {cls.name}"

    @classmethod
    def implementation(cls, config: StrategyConfig) -> type[Strategy]:
        """The class that runs ``config`` (:meth:`choose`'s first half)."""
        return cls.choose(config)[0]

    @classmethod
    def chosen_by(cls, config: StrategyConfig) -> str:
        """The option that chose ``implementation(config)`` (:meth:`choose`'s second half)."""
        return cls.choose(config)[1]

    @classmethod
    def hosts_reason(cls, config: StrategyConfig) -> str | None:
        """Why the transport that ``config`` chooses keeps the job on one host (None: it
        runs across hosts)."""
        return None

    @classmethod
    def check_hosts(cls, config: StrategyConfig, num_nodes: int) -> None:
        """Refuse a job over several hosts when the chosen transport is one host's."""
        reason = cls.hosts_reason(config)
        if reason and num_nodes > 1:
            raise ValueError(
                f"--strategy {cls.name} runs on one host ({num_nodes} hosts in this job): {reason}"
            )

    @classmethod
    def check_device(cls, params: list[torch.Tensor]) -> None:
        """Refuse parameters on a device the strategy does not support (``devices``), with
        :meth:`device_refusal`'s message."""
        found = sorted({p.device.type for p in params} - cls.devices)
        if found:
            raise ValueError(cls.device_refusal(found))

    @classmethod
    def device_refusal(cls, found: list[str]) -> str:
        """Why parameters on the devices ``found`` cannot run here, and the fix (a variant
        that chose its devices says it in its own words)."""
        return (f"--strategy {cls.name} supports parameters on {', '.join(sorted(cls.devices))}, "
                f"but the model has parameters on {', '.join(found)}; move the model to "
                f"{'the CPU' if cls.devices == {'cpu'} else ' or '.join(sorted(cls.devices))}")

    @classmethod
    def check_optimizer(cls, name: str, chosen_by: str = "", grad_clip: float | None = None) -> None:
        """Refuse an optimizer (``--optimizer`` name or class name, any case) or a
        ``--grad-clip`` the strategy cannot honour, with its reason and the fix."""
        label = chosen_by or f"--strategy {cls.name}"
        if cls.optimizers is not None and name.lower() not in cls.optimizers:
            raise ValueError(f"--optimizer {name} with {label}: it applies its own update, which is "
                             f"{' or '.join(sorted(cls.optimizers))}'s only; use --optimizer "
                             f"{sorted(cls.optimizers)[0]}, or drop {label}")
        if grad_clip is not None and cls.grad_clip_reason:
            raise ValueError(f"--grad-clip {grad_clip} with {label}: {cls.grad_clip_reason}; leave "
                             f"--grad-clip out, or use --strategy ssgd")

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
        *,
        transports: Transports | None = None,
    ) -> None:
        planned = building.get()  # built from a plan: its checks were made, once, for this job
        planned = planned if planned is not None and planned.config is config else None
        if planned is None or planned.num_nodes != ctx.num_nodes:
            self.check_hosts(config, ctx.num_nodes)
        if getattr(ctx, "rejoined", False) and not self.rejoins:
            raise ValueError(
                f"host {ctx.node_rank} started again while the job ran, but --strategy {self.name} cannot "
                "take a lost host back (its hosts meet in gloo groups formed once, at the start; only "
                "seasgd, easgd, downpour and hsgd rejoin); restart the whole job instead, from its "
                "latest checkpoint: shmtrain train --resume RUN_DIR")
        self.config = config
        self.ctx = ctx
        self.transports = transports if transports is not None else Transports(ctx)
        self.model = model
        self.optimizer = optimizer
        self.timer = timer or PhaseTimer()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.check_device(self.params)
        if planned is None or not planned.covers(type(optimizer).__name__):
            self.check_optimizer(type(optimizer).__name__, self.chosen_by(config))
        #: clip the gradient's global L2 norm to this in :meth:`step_optimizer` (``--grad-clip``)
        self.grad_clip: float | None = None
        #: False inside :meth:`no_sync`: the gradient hooks do nothing (micro-batches accumulate)
        self.syncing = True
        #: where the parameters live; ``staged``: the strategy copies between it and host
        #: buffers (a GPU, or ``SHMTRAIN_STAGING=copy``) instead of sharing memory with them
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.staged = staged(self.device)
        #: a ``torch.amp.GradScaler`` (``--amp fp16``), attached by :meth:`attach_scaler`
        self.scaler: Any = None
        #: iterations of the run (restored by load_state_dict)
        self.iteration = 0
        #: peers known lost at the end (rank -> iterations they had published), filled by
        #: the strategies that tolerate peer loss (``tolerates_peer_loss``)
        self.lost_peers: dict[int, int] = {}
        #: exchanges of this process (fresh fabric: sequence numbers start here)
        self.steps = 0
        #: iterations this worker is asked to run (set by the training loop; None = no limit)
        self.target_iterations: int | None = None
        #: the job's global weights (flat, in ``layout`` order) read at ``finish`` by the
        #: worker that holds them, for strategies whose workers' own weights are not the
        #: job's model (SEASGD, EASGD, Downpour, HSGD: W_g; DiLoCo: θ^(t)); None otherwise
        self.final_global_weights: torch.Tensor | None = None
        #: why the optimizer must step once, after backward, by the terms of the loop that
        #: drives the strategy (the DDP-style loop, ``--sub-batch``); None: a strategy may
        #: step parts of the model earlier (``ssgd --overlap`` staged, ``strategies/optim/partial_step.py``)
        self.whole_step_reason: str | None = None
        #: >0 while a gradient hook of the strategy runs (an optimizer step from there is
        #: the strategy's own, e.g. gpi's layer-wise update, not the user's)
        self.busy = 0
        self._hooks: list[Any] = []
        if type(self).on_gradient_ready is not Strategy.on_gradient_ready:
            self.register_gradient_hooks()

    def register_gradient_hooks(self, hook: Any = None) -> None:
        """Call ``hook`` (default :meth:`on_gradient_ready`) from every parameter's
        post-accumulate hook (the base does it for a strategy that overrides the method)."""
        call = hook or self.on_gradient_ready

        def guarded(param: torch.Tensor) -> None:
            if self.syncing:
                self.busy += 1
                try:
                    call(param)
                finally:
                    self.busy -= 1

        for p in self.params:
            self._hooks.append(p.register_post_accumulate_grad_hook(guarded))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate into ``param.grad`` and start no exchange (the
        gradient hooks do nothing), as DDP's ``no_sync``; the next backward outside
        communicates the sum (``--accumulate``)."""
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def make_staging(self, layout: FlatLayout) -> HostStaging:
        """The strategy's copies between its parameters' device and host buffers."""
        return HostStaging(layout, self.device)

    # -- mixed precision ----------------------------------------------------------
    @classmethod
    def check_fp16(cls, config: StrategyConfig) -> None:
        """Refuse ``--amp fp16`` when the strategy's update cannot go through a GradScaler."""
        reason = cls.fp16_reason
        if reason:
            raise ValueError(f"--amp fp16 with --strategy {cls.name}: {reason}; use --amp bf16 "
                             "(no loss scaling needed) or --amp none")

    def attach_scaler(self, scaler: Any) -> None:
        """Step the optimizer through ``scaler`` (``--amp fp16``): gradients arrive scaled,
        are reduced as they are (the mean of scaled gradients is the scaled mean), and the
        scaler unscales them, skips a step with inf/NaN and adapts the scale."""
        self.check_fp16(self.config)
        self.scaler = scaler

    def step_optimizer(self) -> None:
        """The optimizer's step, through the GradScaler when one is attached, after
        ``--grad-clip`` (:meth:`clip_gradients`). Unscaling, or an optimizer that writes its
        gradients (``strategies/optim/grad_safety.py``), gets private copies first: a gradient
        that is not staged may be a view of shared memory other workers read."""
        if not self.staged and (self.scaler is not None or writes_gradients(self.optimizer)):
            self.private_gradients(self.params)
        if self.scaler is not None:
            if self.grad_clip is not None:
                self.scaler.unscale_(self.optimizer)
            self.clip_gradients()
            self.scaler.step(self.optimizer)
        else:
            self.clip_gradients()
            self.optimizer.step()

    @staticmethod
    def private_gradients(params: list[torch.Tensor]) -> None:
        """Point every ``param.grad`` at a private copy of itself, once: a gradient copied
        already (``parallel/ddp_style.py`` after backward, then ``step_optimizer``) is not copied again."""
        for p in params:
            if p.grad is not None and not getattr(p.grad, "_shmtrain_private", False):
                p.grad = p.grad.clone()
                p.grad._shmtrain_private = True

    def clip_gradients(self) -> None:
        """``--grad-clip``: scale the gradients by ``max_norm / (norm + 1e-6)`` when that is
        below 1, as ``torch.nn.utils.clip_grad_norm_`` does, but into new tensors: a gradient
        may be a view of a shared slot that other workers read (never written in place)."""
        if self.grad_clip is None:
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return
        norm = torch.nn.utils.get_total_norm(grads)
        coef = float(self.grad_clip / (norm + 1e-6))
        if coef < 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad = p.grad * coef

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
        self.step_optimizer()

    def after_update(self) -> None:
        """Called after the update; closes the iteration."""
        self.iteration += 1
        self.steps += 1

    def should_stop(self) -> bool:
        """True when this worker must end its loop now.

        By default: once ``target_iterations`` are done. Asynchronous strategies override
        this with a termination-alignment policy (ShmCaffe Section III-E), which may end
        a worker before or after its own target.
        """
        return self.target_iterations is not None and self.iteration >= self.target_iterations

    def lost_now(self) -> set[int]:
        """The ranks known lost now, for a strategy that trains on without them (their last
        state is checkpointed on); none by default (a synchronous run ends with one)."""
        return set()

    # -- state ------------------------------------------------------------------
    def quiesce(self) -> None:
        """Drain exchanges still in flight, so ``state_dict`` is consistent (between
        iterations; the strategy keeps working afterwards)."""

    def state_dict(self) -> dict[str, Any]:
        """What this strategy adds to the model's and optimizer's state (call ``quiesce``
        first). Every rank returns its own; buffers the strategy owns come from their owner."""
        return {"iteration": self.iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (collective where the strategy owns shared buffers:
        every rank calls it, between iterations, after the model and optimizer are loaded)."""
        self.iteration = int(state["iteration"])

    def global_weights_now(self) -> torch.Tensor | None:
        """The job's model as it stands, flat in ``layout`` order, on the worker that can
        read it (SEASGD, EASGD, Downpour, HSGD: W_g on rank 0; DiLoCo: θ^(t)), for rank
        0's held-out evaluation; None where the workers' own weights are the job's model."""
        return None

    def finish(self) -> None:
        """Called once after the last iteration."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


#: the :class:`~shmtrain.strategies.plan.Plan` a strategy is being built from (set by
#: ``Plan.build`` around the constructor: the checks it made are not made again)
building: ContextVar[Any] = ContextVar("shmtrain_strategy_plan", default=None)

#: every strategy by name (importing :mod:`shmtrain.strategies` fills it)
STRATEGIES: Registry[type[Strategy]] = Registry("strategy", "--strategy")


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make a strategy selectable by its ``name``."""
    return STRATEGIES.register(cls)


def registry() -> dict[str, type[Strategy]]:
    """All strategies by name (importing :mod:`shmtrain.strategies` fills it)."""
    return STRATEGIES.items()


def get(name: str) -> type[Strategy]:
    return STRATEGIES.get(name)


def own_config(strategy: str, config: StrategyConfig) -> StrategyConfig:
    """``config`` if it is strategy's own Config; the strategy's defaults for the bare
    :class:`StrategyConfig` (the field's default); otherwise an error."""
    cls = get(strategy)
    if type(config) is cls.Config:
        return config
    if type(config) is StrategyConfig:
        return build_config(strategy, {})
    raise ValueError(
        f"strategy_config is a {type(config).__qualname__}, not the Config of --strategy "
        f"{strategy} ({cls.Config.__qualname__}); build it with "
        f"shmtrain.strategies.base.build_config({strategy!r}, options), or use resolve()"
    )


def config_fields(cls: type[Strategy]) -> list[dataclasses.Field]:
    return list(dataclasses.fields(cls.Config))


def build_config(name: str, options: dict[str, Any]) -> StrategyConfig:
    """Build strategy ``name``'s typed Config from ``options``; reject options it does not take."""
    cls = get(name)
    known = {f.name for f in dataclasses.fields(cls.Config)}
    unknown = sorted(set(options) - known)
    if unknown:
        flags = ", ".join("--" + k.replace("_", "-") for k in unknown)
        takes = ", ".join("--" + k.replace("_", "-") for k in sorted(known)) or "no options"
        raise ValueError(f"{flags} does not apply to --strategy {name} (it takes {takes})")
    return cls.Config(**options)

