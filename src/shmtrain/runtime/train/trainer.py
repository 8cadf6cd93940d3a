"""One training-loop body for every caller, and the state a run continues from.

:class:`Trainer` runs one iteration (``zero_grad`` -> forward -> backward -> ``step``)
with the phase timings every strategy shares; ``shmtrain train`` (``runtime/run/loop.py``),
``shmtrain bench step`` and ``bench overlap`` and one's own scripts use it, so the
loop body is written once and checkpointing has one place to live. With ``sub_batch=K``
(``--sub-batch``) forward and backward run in K threads on parts of the batch, their
gradients averaged before the strategy communicates (``runtime/train/subbatch.py``, swCaffe
Algorithm 1); the checkpoint state is the same.

:class:`TrainState` is what the loop itself adds to the model, optimizer and strategy
state: iterations done (which is also the data position: batch ``t`` of the shard
sampler, epoch ``t // steps_per_epoch``) and every RNG state. :meth:`Trainer.state_dict`
gathers the four, and the learning-rate scheduler's state (``"scheduler"``), after the
strategy's ``quiesce()``; :meth:`Trainer.load_state_dict`
puts them back (collective: every rank calls it between iterations), after which the
run continues as if it had not stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from copy import deepcopy
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from shmtrain.runtime.tasks.base import Task, batch_size, split_batch, to_device
from shmtrain.runtime.train import rng_state
from shmtrain.runtime.train.engine import (
    Accumulating,
    CheckpointSink,
    DDPStyled,
    Looping,
    ProgressLine,
    RunMonitor,
    Scaled,
    Stateful,
    Steppable,
    StopSignal,
    SubBatched,
)
from shmtrain.runtime.train.finite import check_loss, json_text
from shmtrain.runtime.train.schedule import check_state, current_lr, step_scheduler
from shmtrain.runtime.train.subbatch import SubBatch
from shmtrain.timing import PhaseTimer


class CriterionTask(Task):
    """A plain ``loss_fn(output, target)`` (e.g. ``nn.CrossEntropyLoss()``) as a task of
    ``(input, ..., target)`` batches, for callers that give the Trainer a loss module."""

    name = "criterion"

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        super().__init__()
        self.loss_fn = loss_fn

    def loss(self, model: Callable[..., Any], batch: Any) -> torch.Tensor:
        return self.loss_fn(*self.forward(model, batch))

    def criterion(self) -> Callable[[Any, Any], torch.Tensor]:
        return self.loss_fn


@dataclass
class TrainState:
    """The loop's own state: iterations done (= the data position) and the RNG states."""

    iteration: int = 0
    rng: dict[str, Any] = field(default_factory=dict)

    def position(self, steps_per_epoch: int) -> tuple[int, int]:
        """(epoch, batch within the epoch) of the next batch."""
        return divmod(self.iteration, max(1, steps_per_epoch))

    def capture_rng(self) -> None:
        """Record the torch (and, once CUDA is in use, every GPU's), numpy and Python RNG
        states of this process, as values a checkpoint holds (``runtime/train/rng_state.py``)."""
        self.rng = rng_state.capture()

    def restore_rng(self) -> None:
        """Put the recorded RNG states back (nothing when none were recorded)."""
        if self.rng:
            rng_state.restore(self.rng)


@dataclass
class RunServices:
    """What a run of ``shmtrain train`` keeps around its iterations, handed to
    :meth:`Trainer.train`: the checkpointer (``runtime/checkpoint/checkpointer.py``), the stop request
    (Ctrl-C / SIGTERM, ``runtime/train/stop.py``), the monitor (rank 0's evaluation and
    TensorBoard, ``runtime/run/monitor.py``), this rank's metrics file and the progress line.
    Their owner (``runtime/run/loop.py``) opens and closes them."""

    checkpoints: CheckpointSink
    stop: StopSignal
    monitor: RunMonitor
    log: IO[str]
    progress: ProgressLine
    #: this worker's rank (named when its loss diverges)
    rank: int = 0


@dataclass
class TrainOutcome:
    """What :meth:`Trainer.train` ends with."""

    #: seconds from the first iteration to the last checkpoint's start
    wall_s: float
    #: the last iteration's loss (None when no iteration ran)
    final_loss: float | None
    #: the checkpoint the run ended with (None: no checkpoints)
    checkpoint: Path | None
    #: iterations this call ran (0: a finished run resumed at its total)
    trained: int = 0


class Trainer:
    """One iteration of data-parallel training, timed the same way for every strategy.

    Args:
        engine: the wrapped model (``DataParallel``) or an adapter with its three calls
            (:class:`Steppable`); the options below need more of it (the protocols above:
            :class:`SubBatched`, :class:`Accumulating`, :class:`Scaled`; :meth:`train`
            :class:`Looping`, checkpoints :class:`Stateful`).
        loss_fn: the task (``runtime/tasks/``: the loss of ``(model, batch)`` for batches of
            any structure), or a plain ``loss_fn(output, target)`` for ``(input, target)``
            batches (:class:`CriterionTask`).
        timer: receives ``forward`` and ``backward`` (the engine adds its own phases).
        scheduler: a learning-rate scheduler on the engine's optimizer, stepped once per
            iteration after the engine's step (``runtime/train/schedule.py``); its state is part
            of :meth:`state_dict`, so a resumed run continues the schedule exactly.
        sub_batch: K, the threads each mini-batch is split over (swCaffe Algorithm 1,
            :class:`shmtrain.runtime.train.subbatch.SubBatch`); 1 runs forward and backward on
            the calling thread. K > 1 needs a :class:`SubBatched` engine, a task with a
            ``criterion()`` and ``(input, target)`` batches; :meth:`close` ends the threads.
        amp: ``"bf16"`` runs forward and the loss under ``torch.autocast`` with bfloat16
            (``--amp bf16``); ``"fp16"`` with float16, the loss scaled by a
            ``torch.amp.GradScaler`` before backward and the optimizer stepped through it
            (the strategy's ``attach_scaler``: the gradients are reduced scaled, then
            unscaled, a step with inf/NaN skipped, and the scale adapted after every
            step); backward, the gradients, the strategies' buffers and the optimizer stay
            float32 (master weights); ``"none"`` (default) is float32 only.
        accumulate: K, the micro-batches each batch is run as, one after the other
            (``--accumulate``): the first K-1 backward passes inside the engine's
            ``no_sync()`` (no exchange), each loss weighted by its share of the batch, so
            the gradient that is exchanged and stepped with is the whole batch's.

    The batch is moved to the model's device (a GPU worker's batch comes from host memory)
    and autocast runs on that device.
    """

    def __init__(self, engine: Steppable, loss_fn: Task | Callable[[Any, Any], torch.Tensor], timer: PhaseTimer,
                 scheduler: LRScheduler | None = None, sub_batch: int = 1, amp: str = "none",
                 accumulate: int = 1) -> None:
        if amp not in ("none", "bf16", "fp16"):
            raise ValueError(f"--amp {amp!r}: choose none, bf16 or fp16")
        self.bf16 = amp == "bf16"
        self.amp = amp
        self.engine = engine
        if isinstance(engine, DDPStyled) and engine.ddp_style:  # this loop steps with engine.step()
            engine.ddp_style = False
        module = getattr(engine, "module", engine)
        first = next(module.parameters(), None) if isinstance(module, nn.Module) else None
        #: where the model computes (the batch is moved there)
        self.device = first.device if first is not None else torch.device("cpu")
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
        self.scaler: torch.amp.GradScaler | None = None
        if amp == "fp16":
            if not isinstance(engine, Scaled):
                raise ValueError(f"--amp fp16 steps the optimizer through a GradScaler, which a "
                                 f"{type(engine).__name__} cannot take; wrap the model in "
                                 "shmtrain.parallel.data_parallel.DataParallel, or use --amp bf16")
            if sub_batch != 1:
                raise ValueError(f"--amp fp16 with --sub-batch {sub_batch}: the sub-batch threads run bf16 "
                                 "or float32 only (no GradScaler); use --amp bf16, or --sub-batch 1")
            self.scaler = torch.amp.GradScaler(self.device.type)
            engine.attach_scaler(self.scaler)
        if sub_batch != 1 and self.device.type != "cpu":
            raise ValueError(f"--sub-batch {sub_batch}: the sub-batch threads split a batch over CPU "
                             f"cores (swCaffe's core groups), but the model is on {self.device}; use "
                             "--sub-batch 1 (one larger batch) on a GPU")
        if accumulate < 1 or (accumulate > 1 and sub_batch != 1):
            raise ValueError(f"--accumulate {accumulate}: K micro-batches, at least 1, and not with "
                             f"--sub-batch {sub_batch} threads; use --accumulate 1, or --sub-batch 1")
        #: the engine's no_sync() and module, with --accumulate K > 1
        self.accumulating: Accumulating | None = None
        if accumulate > 1:
            if not isinstance(engine, Accumulating):
                raise ValueError(f"--accumulate {accumulate}: the micro-batches before the last run inside the "
                                 f"engine's no_sync(), which a {type(engine).__name__} does not have; wrap the "
                                 "model in shmtrain.parallel.data_parallel.DataParallel, or use --accumulate 1")
            self.accumulating = engine
        self.accumulate = accumulate
        #: the loss and metrics of a batch (``runtime/tasks/``)
        self.task: Task = loss_fn if isinstance(loss_fn, Task) else CriterionTask(loss_fn)
        self.timer = timer
        self.scheduler = scheduler
        self.sub_batch: SubBatch | None = None
        self.sub_engine: SubBatched | None = None
        if sub_batch != 1:
            self.sub_batch, self.sub_engine = self._sub_batch(engine, sub_batch)
            strategy = getattr(engine, "strategy", None)
            if strategy is not None:  # the parts' threads run copies of the model (not checked per bucket)
                strategy.whole_step_reason = (f"--sub-batch {sub_batch}: the parts' threads run copies of the "
                                              "model while backward goes on")
        self.state = TrainState()
        #: keys added to this stretch's first metrics row (``defaults``: what the run's setting chose)
        self.first_row: dict[str, Any] = {}
        #: the learning rate the last :meth:`step` used (None before the first step, or
        #: when the engine has no ``optimizer`` and there is no scheduler)
        self.lr: float | None = None
        #: the loss of the step under way, until the next one starts
        self.pending_loss: torch.Tensor | None = None

    def _sub_batch(self, engine: Steppable, parts: int) -> tuple[SubBatch, SubBatched]:
        """The sub-batch threads (``--sub-batch K``) and the engine they copy."""
        if not isinstance(engine, SubBatched):
            raise ValueError(
                f"--sub-batch {parts}: the threads run copies of the engine's module, but a "
                f"{type(engine).__name__} has no module and before_forward; wrap the model in "
                "shmtrain.parallel.data_parallel.DataParallel, or use --sub-batch 1")
        criterion = self.task.criterion()
        if criterion is None:
            raise ValueError(f"--sub-batch {parts} with --task {self.task.name}: the threads split (input, "
                             "target) batches scored by a loss(output, target), which this task has not; "
                             "use --sub-batch 1")
        return SubBatch(engine.module, parts, criterion, self.timer, bf16=self.bf16), engine

    def step(self, *batch: Any) -> torch.Tensor:
        """zero_grad -> forward (``forward``) -> backward (``backward``) -> step; the loss.

        ``step(batch)`` takes one batch of any structure the task reads; ``step(x, y)``
        is ``step((x, y))``."""
        engine = self.engine
        data = to_device(batch[0] if len(batch) == 1 else batch, self.device)  # from host memory
        engine.zero_grad()
        if self.sub_batch is not None and self.sub_engine is not None:  # both phases timed inside
            if not isinstance(data, tuple | list) or len(data) != 2:
                raise ValueError(f"--sub-batch: the threads split (input, target) batches, not a "
                                 f"{type(data).__name__}; use --sub-batch 1")
            loss = self.sub_batch.step(data[0], data[1], before_forward=self.sub_engine.before_forward)
        elif self.accumulating is None:
            loss = self._pass(engine, data)
        else:
            loss = self._accumulate(self.accumulating, data)
        optimizer = self.scheduler.optimizer if self.scheduler is not None else getattr(engine, "optimizer", None)
        self.lr = current_lr(optimizer) if optimizer is not None else None
        self.pending_loss = loss  # the loss of the step under way (a recovery logs it: runtime/run/recovery.py)
        engine.step()
        if self.scaler is not None:
            self.scaler.update()
        if self.scheduler is not None:
            step_scheduler(self.scheduler)
        self.state.iteration += 1
        return loss

    def _pass(self, forward: Callable[..., Any], batch: Any, weight: float = 1.0) -> torch.Tensor:
        """Forward (``forward``) and backward (``backward``) of one batch or micro-batch,
        its loss weighted by ``weight`` before backward."""
        dtype = self.autocast_dtype
        with self.timer.phase("forward"), torch.autocast(self.device.type, dtype=dtype or torch.bfloat16,
                                                         enabled=dtype is not None):
            loss = self.task.loss(forward, batch)
            if weight != 1.0:
                loss = loss * weight
        with self.timer.phase("backward"):
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        return loss

    def _accumulate(self, engine: Accumulating, batch: Any) -> torch.Tensor:
        """``--accumulate K``: the batch as K micro-batches (sizes differ by at most 1); the
        engine's ``forward`` (with its ``before_forward``) runs once, on the first, the
        module itself on the others; all but the last backward inside ``no_sync()``."""
        total = torch.zeros((), device=self.device)
        parts = split_batch(batch, self.accumulate)
        size = batch_size(batch)
        for i, part in enumerate(parts):
            forward = self.engine if i == 0 else engine.module
            weight = batch_size(part) / size
            if i < len(parts) - 1:
                with engine.no_sync():
                    total += self._pass(forward, part, weight).detach()
            else:
                total += self._pass(forward, part, weight).detach()
        return total

    def train(self, next_batch: Callable[[], Any], run: RunServices, total: int) -> TrainOutcome:
        """The loop of ``shmtrain train``, until the engine says stop (its target, or a
        termination policy, TERM) or a stop is requested: per iteration the next batch
        (phase ``data``), :meth:`step`, one JSON line in ``run.log`` (loss, lr, start
        ``t0``, phases), the monitor and progress line outside the iteration's time, a
        checkpoint when due; then the last evaluation and the final checkpoint."""
        engine, timer = self.engine, self.timer
        if not isinstance(engine, Looping):
            raise TypeError(f"Trainer.train: a {type(engine).__name__} has no iteration and should_stop(); "
                            "wrap the model in shmtrain.parallel.data_parallel.DataParallel")
        start = time.perf_counter()
        value: float | None = None
        first = engine.iteration
        while not engine.should_stop():
            iter_start = time.perf_counter()
            with timer.phase("data"):
                batch = next_batch()
            loss = self.step(batch)
            phases = timer.finish_iteration()
            phases["iteration"] = time.perf_counter() - iter_start
            value = float(loss.detach())
            iteration = engine.iteration
            row = {"iteration": iteration, "loss": value, "lr": self.lr,
                   "t0": run.monitor.stamp(iter_start), "time": phases, **timer.take_details()}
            if iteration == first + 1 and self.first_row:  # e.g. the defaults the run's setting chose
                row.update(self.first_row)
            run.log.write(json_text(row) + "\n")  # NaN/inf as null, flagged (runtime/train/finite.py)
            # diverged: stop, name it (and the cause: --amp fp16's range, the data, the updates)
            check_loss(value, iteration, run.rank, self.lr, self.amp, first=first == 0 and iteration == 1)
            run.monitor.after_iteration(row, run.log)  # outside the iteration's time
            run.progress.update(iteration, value)
            if run.stop.check(iteration):
                break
            if run.checkpoints.due(iteration, total):
                run.log.flush()  # rows up to the checkpoint are on disk before it is
                run.checkpoints.save(self, iteration)
        iteration = engine.iteration
        run.stop.finished(iteration)
        if iteration > first:  # a finished run resumed at its total has its last eval row
            run.monitor.finish(iteration, run.log)
        run.progress.close()
        wall = time.perf_counter() - start
        run.log.flush()
        saved = run.checkpoints.save_final(self, run.stop.target if run.stop.stopped and run.stop.target is not None
                                           else total)
        return TrainOutcome(wall, value, saved, iteration - first)

    def close(self) -> None:
        """End the sub-batch threads, if any (the engine is closed by its owner)."""
        if self.sub_batch is not None:
            self.sub_batch.close()

    # -- state (checkpoints) ------------------------------------------------------
    def _stateful(self) -> Stateful:
        """The engine as :class:`Stateful` (a checkpoint needs its module, optimizer and
        strategy)."""
        if not isinstance(self.engine, Stateful):
            raise TypeError(f"Trainer state: a {type(self.engine).__name__} has no module, optimizer and "
                            "strategy to save; wrap the model in shmtrain.parallel.data_parallel.DataParallel")
        return self.engine

    def state_dict(self, copy: bool = True, quiesce: bool = True) -> dict[str, Any]:
        """The model, optimizer, strategy and loop state of this rank, consistent between
        iterations (the strategy's exchanges in flight are drained first; not with
        ``quiesce=False``, for a rank whose peer is gone: ``runtime/run/recovery.py``). With
        ``copy`` a deep-copied snapshot, so training on does not change it; without, the
        live tensors, for a caller that serializes them before the next iteration (the
        checkpointer: no extra pass over the weights and momentum)."""
        dp = self._stateful()
        strategy = dp.strategy
        if quiesce:
            strategy.quiesce()
        self.state.capture_rng()
        state = {
            "model": dp.module.state_dict(),
            "optimizer": dp.optimizer.state_dict(),
            "strategy": strategy.state_dict(),
            "train": asdict(self.state),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            # --amp fp16: the loss scale and its growth tracker (a resumed run goes on with them)
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }
        return deepcopy(state) if copy else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (collective: every rank, between iterations)."""
        dp = self._stateful()
        strategy = dp.strategy
        strategy.quiesce()
        with torch.no_grad():
            dp.module.load_state_dict(state["model"])
        dp.optimizer.load_state_dict(state["optimizer"])
        strategy.load_state_dict(state["strategy"])
        saved = state.get("scheduler")  # absent in states saved before schedules existed
        if self.scheduler is not None and saved is not None:
            check_state(self.scheduler, saved)
            self.scheduler.load_state_dict(saved)
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.state = TrainState(**state["train"])
        self.state.restore_rng()
