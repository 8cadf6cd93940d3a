"""What :class:`shmtrain.runtime.train.trainer.Trainer` needs of its collaborators, as
protocols: the engine (:class:`Steppable`, and what ``--sub-batch``, ``--accumulate``,
``--amp fp16``, checkpoints and the loop need more of it) and the run's services around
the loop (checkpointer, stop request, monitor, progress line). ``shmtrain.parallel.data_parallel.DataParallel``
is every engine protocol at once; a benchmark's DDP adapter is only :class:`Steppable`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

import torch
from torch import nn


class Steppable(Protocol):
    """What :class:`Trainer` drives: :class:`shmtrain.parallel.data_parallel.DataParallel`, or an adapter
    with the same three calls (e.g. DDP in the benchmarks)."""

    def zero_grad(self) -> None: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def step(self) -> None: ...


@runtime_checkable
class DDPStyled(Protocol):
    """An engine that may communicate inside ``backward()`` (``DataParallel.ddp_style``)."""

    ddp_style: bool


@runtime_checkable
class Scaled(Protocol):
    """An engine that steps its optimizer through a GradScaler (``--amp fp16``)."""

    def attach_scaler(self, scaler: torch.amp.GradScaler) -> None: ...


@runtime_checkable
class SubBatched(Protocol):
    """An engine whose module the sub-batch threads copy (``--sub-batch``)."""

    module: nn.Module

    def before_forward(self) -> None: ...


@runtime_checkable
class Accumulating(Protocol):
    """An engine with ``no_sync()`` (``--accumulate``: no exchange before the last part)."""

    module: nn.Module

    def no_sync(self) -> contextlib.AbstractContextManager[None]: ...


class StrategyState(Protocol):
    """The strategy's part of a checkpoint (``shmtrain.strategies.base.Strategy``)."""

    def quiesce(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class Stateful(Protocol):
    """An engine whose model, optimizer and strategy state a checkpoint holds."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    strategy: StrategyState


@runtime_checkable
class Looping(Protocol):
    """An engine that says when the run ends (``DataParallel``: its strategy's target and
    termination policy)."""

    @property
    def iteration(self) -> int: ...

    def should_stop(self) -> bool: ...


class CheckpointSink(Protocol):
    """Where :meth:`Trainer.train` saves (``runtime/checkpoint/checkpointer.py``)."""

    def due(self, iteration: int, total: int) -> bool: ...

    def save(self, trainer: Any, step: int) -> None: ...

    def save_final(self, trainer: Any, proposal: int) -> Path | None: ...


class StopSignal(Protocol):
    """A requested stop (Ctrl-C / SIGTERM), agreed between ranks (``runtime/train/stop.py``)."""

    stopped: bool
    target: int | None

    def check(self, iteration: int) -> bool: ...

    def finished(self, iteration: int) -> None: ...


class RunMonitor(Protocol):
    """Rank 0's held-out evaluation and TensorBoard (``runtime/run/monitor.py``)."""

    def stamp(self, perf: float) -> float: ...

    def after_iteration(self, row: dict[str, Any], log: IO[str]) -> dict[str, Any] | None: ...

    def finish(self, iteration: int, log: IO[str]) -> dict[str, Any] | None: ...


class ProgressLine(Protocol):
    """The progress line on stderr (``runtime/outputs/progress.py``)."""

    def update(self, iteration: int, loss: float) -> None: ...

    def close(self) -> None: ...
