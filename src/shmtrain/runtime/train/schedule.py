"""Learning-rate schedules of ``shmtrain train``, built from ``torch.optim.lr_scheduler``.

``--lr-schedule constant|step|cosine`` with ``--warmup-iterations N``: the scheduler is
stepped once per iteration (by :class:`shmtrain.runtime.train.trainer.Trainer`, after the
engine's step), so "iteration" is its unit everywhere, and the values are torch's own:

========== ==================================================================================
warm-up    ``LinearLR(start_factor=1/(N+1), end_factor=1, total_iters=N)``: iteration ``i < N``
           uses ``lr * (i+1)/(N+1)``, iteration ``N`` the full ``--lr``
constant   ``ConstantLR(factor=1, total_iters=0)``: ``--lr`` throughout
step       ``StepLR(step_size=--lr-step-every, gamma=--lr-gamma)``: times ``gamma`` every
           ``--lr-step-every`` iterations after warm-up (default: a third of them)
cosine     ``CosineAnnealingLR(T_max=planned - N, eta_min=--lr-min)``, then
           ``ConstantLR(factor=lr_min/lr)``: down to ``--lr-min`` at the last planned
           iteration, held there if a worker runs on (asynchronous termination policies)
========== ==================================================================================

Warm-up and the schedule are chained with ``SequentialLR`` (milestone ``N``). Every rank
builds the same scheduler on its own optimizer and steps it every iteration, so the
learning rate is the same on every rank whether or not that rank's optimizer steps
(``ps_grad`` and ``ps_weight`` step only the server's, ``gpi`` only the root's).
"""

from __future__ import annotations

import typing
import warnings
from typing import Any, Literal, Protocol

import torch
from torch.optim.lr_scheduler import (
    ConstantLR,
    CosineAnnealingLR,
    LinearLR,
    LRScheduler,
    SequentialLR,
    StepLR,
)


class ScheduleOptions(Protocol):
    """The options :func:`from_config` reads (``TrainConfig`` has them; the config imports
    :data:`Schedule` from here, so this module names no config class)."""

    lr_schedule: str
    warmup_iterations: int
    lr_step_every: int | None
    lr_gamma: float
    lr_min: float

#: the values of ``--lr-schedule``
Schedule = Literal["constant", "step", "cosine"]
SCHEDULES: tuple[str, ...] = typing.get_args(Schedule)

#: iterations the cosine schedule holds ``--lr-min`` after the planned ones (no end)
HOLD_ITERATIONS = 2**31 - 1

#: torch's warning when a scheduler steps on a rank whose optimizer never steps
_NOT_STEPPED = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    schedule: str = "constant",
    *,
    total_iterations: int,
    warmup_iterations: int = 0,
    step_every: int | None = None,
    gamma: float = 0.1,
    lr_min: float = 0.0,
) -> LRScheduler:
    """The scheduler of ``schedule`` on ``optimizer`` (its ``lr`` is the peak rate).

    Args:
        optimizer: the optimizer whose groups' ``lr`` it sets (once per iteration).
        schedule: ``constant``, ``step`` or ``cosine``.
        total_iterations: the iterations the run plans (cosine ends its decay there).
        warmup_iterations: linear warm-up before the schedule (0: none).
        step_every: ``step``: iterations between decays (None: a third of the
            iterations after warm-up, at least 1).
        gamma: ``step``: the factor of each decay.
        lr_min: ``cosine``: the rate it decays to.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"--lr-schedule {schedule!r} is unknown; choose one of: {', '.join(SCHEDULES)}")
    if warmup_iterations < 0:
        raise ValueError(f"--warmup-iterations {warmup_iterations}: must not be negative; use 0 for none")
    group = optimizer.param_groups[0]
    peak = float(group.get("initial_lr", group["lr"]))
    if schedule == "cosine" and not 0 <= lr_min <= peak:
        raise ValueError(f"--lr-min {lr_min}: must be in [0, --lr {peak}]; use e.g. --lr-min 0")
    after = max(1, total_iterations - warmup_iterations)
    parts: list[LRScheduler] = []
    milestones: list[int] = []
    if warmup_iterations:
        parts.append(LinearLR(optimizer, start_factor=1.0 / (warmup_iterations + 1), end_factor=1.0,
                              total_iters=warmup_iterations))
        milestones.append(warmup_iterations)
    if schedule == "constant":
        parts.append(ConstantLR(optimizer, factor=1.0, total_iters=0))
    elif schedule == "step":
        every = step_every if step_every is not None else max(1, after // 3)
        parts.append(StepLR(optimizer, step_size=every, gamma=gamma))
    else:
        parts.append(CosineAnnealingLR(optimizer, T_max=after, eta_min=lr_min))
        parts.append(ConstantLR(optimizer, factor=min(1.0, lr_min / peak), total_iters=HOLD_ITERATIONS))
        milestones.append(warmup_iterations + after)
    if len(parts) == 1:
        return parts[0]
    return SequentialLR(optimizer, parts, milestones=milestones)


def from_config(optimizer: torch.optim.Optimizer, config: ScheduleOptions, total_iterations: int) -> LRScheduler:
    """:func:`build_scheduler` from ``shmtrain train``'s options (``--lr-schedule`` & co.)."""
    return build_scheduler(
        optimizer, config.lr_schedule, total_iterations=total_iterations,
        warmup_iterations=config.warmup_iterations, step_every=config.lr_step_every,
        gamma=config.lr_gamma, lr_min=config.lr_min,
    )


def step_scheduler(scheduler: LRScheduler) -> None:
    """One scheduler step, without torch's "scheduler stepped before the optimizer"
    warning: on ranks that never step their optimizer (a parameter server's workers)
    the schedule must still advance, so the rate is the same everywhere."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NOT_STEPPED, category=UserWarning)
        scheduler.step()


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate of the optimizer's first parameter group (what the next step uses)."""
    return float(optimizer.param_groups[0]["lr"])


def check_state(scheduler: LRScheduler, state: dict[str, Any]) -> None:
    """Refuse a scheduler state saved from another schedule (its keys differ), which
    torch would load without a word and then run a mixture of the two."""
    if _shape(scheduler.state_dict()) != _shape(state):
        raise ValueError(
            f"the saved learning-rate schedule ({describe_state(state)}) is not this run's "
            f"({describe_state(scheduler.state_dict())}); resume with the --lr-schedule and "
            "--warmup-iterations the run was started with"
        )


def describe_state(state: dict[str, Any]) -> str:
    """A short name of a scheduler state: its parts by their distinguishing keys."""
    names = {"start_factor": "warm-up", "step_size": "step", "T_max": "cosine", "factor": "constant"}
    parts = state.get("_schedulers", [state])
    found = [next((name for key, name in names.items() if key in part), "?") for part in parts]
    return " then ".join(found)


def _shape(state: dict[str, Any]) -> Any:
    if "_schedulers" in state:
        return tuple(_shape(part) for part in state["_schedulers"])
    return tuple(sorted(state))


def depends_on_length(config: ScheduleOptions) -> bool:
    """Whether the schedule is drawn over the run's planned iterations (cosine decays to
    ``--lr-min`` at the last one; step decays every third of them unless
    ``--lr-step-every``), so a run resumed to another length would not follow it."""
    return config.lr_schedule == "cosine" or (config.lr_schedule == "step" and config.lr_step_every is None)


def extended_resume(config: ScheduleOptions, planned: int, done: int, total: int, flag: str) -> str | None:
    """Why a run resumed to ``total`` iterations cannot simply continue a schedule planned
    over ``planned`` (``done`` of them trained), with the fixes; None when it can.

    A cosine schedule holds ``--lr-min`` after its planned end, so extending a finished
    cosine run at ``--lr-min 0`` would train every added iteration at learning rate 0.
    ``flag``: the run-length option given (``--epochs 20``).
    """
    if total == planned or not depends_on_length(config):
        return None
    ended = done >= planned
    if config.lr_schedule == "cosine":
        what = (f"it ended at iteration {planned}, where the learning rate is --lr-min {config.lr_min}"
                if ended else f"it reaches --lr-min {config.lr_min} at iteration {planned} and stays there")
    else:
        what = f"its decays are spaced by a third of {planned} iterations"
    left = total - done
    new = (f"over the {left} iterations left (a warm restart: its --warmup-iterations {config.warmup_iterations} "
           "warm-up again, then from the peak --lr)" if config.warmup_iterations else
           f"from the peak --lr over the {left} iterations left (a warm restart)")
    return (f"{flag}: the run's {config.lr_schedule} learning-rate schedule was planned over {planned} "
            f"iterations ({done} done); {what}, so the {left} iterations to {total} would not follow "
            f"a schedule planned for them. Add --restart-schedule to run a new {config.lr_schedule} schedule "
            f"{new}, or resume to the "
            f"planned length (give the run's own --iterations {planned}, or leave --iterations/--epochs out)")


def restart(optimizer: torch.optim.Optimizer, config: ScheduleOptions, iterations: int) -> LRScheduler:
    """``--restart-schedule``: a new schedule over the ``iterations`` left, built as the run's
    own was (its warm-up first, when ``--warmup-iterations`` is set, then the schedule from
    the peak rate, the optimizer's ``initial_lr``; SGDR's warm restart, Loshchilov & Hutter)."""
    for group in optimizer.param_groups:  # the peak, not the rate the old schedule ended at
        group["lr"] = group.get("initial_lr", group["lr"])
    return from_config(optimizer, config, max(1, iterations))
