"""Rank 0's view of a run while it trains: held-out evaluation and TensorBoard scalars.

:class:`Monitor` is called by the worker loop (``runtime/run/loop.py``) after each
iteration's metrics row is written, outside the iteration's timing:

- every ``--eval-every`` iterations (default: each epoch) rank 0 computes the task's
  held-out metrics (``runtime/tasks/``: loss and accuracy for classification, loss and
  rmse for regression, loss and perplexity for a language model), in batches under ``no_grad`` with the model in
  ``eval()`` mode, and
  writes ``{"eval": {"iteration", "loss", <metric>, "t0", "time"}}`` to its metrics
  file (``time``: seconds the evaluation took; the other ranks wait for rank 0 at their
  next exchange meanwhile, which their ``comm`` shows); for a strategy whose job model
  is not rank 0's own weights (SEASGD, EASGD, Downpour, HSGD: W_g; DiLoCo: θ^(t);
  ``Strategy.global_weights_now``) it is that model that is evaluated, on a copy of
  rank 0's module, and the row says ``"weights": "global"``;
- with ``--tensorboard`` rank 0 writes ``loss/train``, ``lr``, ``time_ms/<phase>`` per
  iteration and ``<metric>/held_out`` (``loss``, ``accuracy``, ...) per evaluation to
  ``RUN_DIR/tensorboard/`` (``torch.utils.tensorboard.SummaryWriter``).

Times in the rows (``t0``) are seconds since the epoch on one clock per rank: the wall
time at the loop's start plus ``perf_counter`` differences, so the iterations and
evaluations of a rank never overlap and ranks of one host line up (``runtime/outputs/trace.py``).
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn
from torch.nn import functional

from shmtrain.runtime.config import TrainConfig
from shmtrain.runtime.outputs.progress import evaluation_progress
from shmtrain.runtime.outputs.selection import Selection
from shmtrain.runtime.tasks.base import Task
from shmtrain.runtime.tasks.lookup import build_task
from shmtrain.runtime.train.finite import json_text

#: samples per forward pass of the held-out evaluation
EVAL_BATCH = 256


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = EVAL_BATCH) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on ``(x, y)``, in batches, in ``eval()``
    mode (the model's mode is restored)."""
    return evaluate_batches(model, ((x[s : s + batch], y[s : s + batch]) for s in range(0, len(x), batch)))


@torch.no_grad()
def evaluate_batches(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` over ``batches`` of ``(x, y)`` (a
    folder's held-out set from its DataLoader, ``runtime/data/loader.py``), in ``eval()`` mode
    (the model's mode is restored)."""
    was_training = model.training
    model.eval()
    try:
        loss, correct, n = 0.0, 0, 0
        device = next(model.parameters()).device
        for xb, yb in batches:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            out = model(xb)
            loss += float(functional.cross_entropy(out, yb, reduction="sum"))
            correct += int((out.argmax(1) == yb).sum())
            n += len(yb)
    finally:
        model.train(was_training)
    n = max(1, n)
    return loss / n, correct / n


def eval_interval(config: TrainConfig, train_samples: int, world: int) -> int:
    """Iterations between evaluations: ``--eval-every``, or one epoch over the sharded
    data (0: none during the run)."""
    if config.eval_every is not None:
        return config.eval_every
    return max(1, train_samples // (config.batch_size * world))


class Monitor:
    """Held-out evaluation and TensorBoard scalars of one rank (only rank 0 does either).

    Args:
        config: the run's configuration (``eval_every``, ``tensorboard``).
        out: the run folder.
        rank: this worker's rank.
        model: the model to evaluate (the plain module, not the data-parallel wrapper,
            so evaluating starts no exchange).
        data: the data set (``train_samples`` for the epoch length; ``test_x``, ``test_y``
            held out unless ``held_out`` is given).
        world: workers in the job.
        held_out: the held-out batches (``runtime/data/loader.py``'s ``HeldOut``).
        strategy: the strategy whose job model is evaluated where it is not ``model``.
        task: what the held-out metrics are (``runtime/tasks/``; default classification:
            loss and accuracy).
        selection: ``--keep-best`` and ``--early-stop`` (``runtime/outputs/selection.py``),
            told of every evaluation.
    """

    def __init__(self, config: TrainConfig, out: Path, rank: int, model: nn.Module, data: Any,
                 world: int, held_out: Iterable[Any] | None = None,
                 strategy: Any = None, task: Task | None = None, selection: Selection | None = None) -> None:
        self.task = task if task is not None else build_task("classification")
        self.selection = selection if selection is not None and selection.active and rank == 0 else None
        self.wall0 = time.time()
        self.perf0 = time.perf_counter()
        self.active = rank == 0
        self.model = model
        #: the job's model, when it is not ``model`` (``Strategy.global_weights_now``)
        self.job_model = GlobalModel(model, strategy) if self.active and strategy is not None else None
        # tensors (hosts_ddp's data): slices, iterable again at every evaluation
        self.held_out = held_out if held_out is not None else _Slices(data.test_x, data.test_y)
        self.every = eval_interval(config, data.train_samples, world) if self.active else 0
        #: a line on the terminal while a long evaluation runs (``--progress``)
        self.progress = (self.active and bool(getattr(config, "progress", False))
                         and os.environ.get("SHMTRAIN_NO_PROGRESS") != "1")
        self.samples = len(self.held_out) if hasattr(self.held_out, "__len__") else len(data.test_x)
        self.last_eval: int | None = None
        #: the metrics of that evaluation, and whether they were the job model's (W_g, θ)
        self.last_metrics: dict[str, Any] | None = None
        self.last_was_global = False
        self.writer: Any = None
        if self.active and config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(out / "tensorboard"))

    def stamp(self, perf: float) -> float:
        """A ``time.perf_counter()`` reading as seconds since the epoch (one clock per rank)."""
        return round(self.wall0 + (perf - self.perf0), 6)

    def after_iteration(self, row: dict[str, Any], log: IO[str]) -> dict[str, Any] | None:
        """TensorBoard scalars of the iteration's ``row``; an evaluation when one is due
        (written to ``log``, returned)."""
        if not self.active:
            return None
        iteration = row["iteration"]
        if self.writer is not None:
            self.writer.add_scalar("loss/train", row["loss"], iteration)
            if row.get("lr") is not None:
                self.writer.add_scalar("lr", row["lr"], iteration)
            for phase, seconds in row["time"].items():
                self.writer.add_scalar(f"time_ms/{phase}", seconds * 1e3, iteration)
        if self.every and iteration % self.every == 0:
            return self.evaluate(iteration, log)
        return None

    def finish(self, iteration: int, log: IO[str]) -> dict[str, Any] | None:
        """After the last iteration: evaluate once more unless that iteration was, so the
        accuracy curve ends where the run did."""
        if self.active and self.every and iteration > 0 and self.last_eval != iteration:
            return self.evaluate(iteration, log)
        return None

    def evaluate(self, iteration: int, log: IO[str]) -> dict[str, Any]:
        """The task's held-out metrics now (loss and accuracy for classification): one
        ``eval`` row in ``log`` (and TensorBoard)."""
        start = time.perf_counter()
        job_model = self.job_model() if self.job_model is not None else None
        batches = self.held_out
        if self.progress:  # a long evaluation says how far it is
            batches = evaluation_progress(self.held_out, self.samples, iteration)
        metrics = self.task.evaluate(job_model or self.model, batches)
        seconds = time.perf_counter() - start
        entry = {"iteration": iteration, **metrics, "t0": self.stamp(start), "time": seconds}
        if job_model is not None:
            entry["weights"] = "global"
        log.write(json_text({"eval": entry}) + "\n")  # a NaN/inf loss as null, flagged
        if self.selection is not None:  # best.pt, the early stop
            self.selection.after_eval(entry, job_model or self.model)
        self.last_eval = iteration
        self.last_metrics, self.last_was_global = dict(metrics), job_model is not None
        if self.writer is not None:
            for name, value in metrics.items():
                self.writer.add_scalar(f"{name}/held_out", value, iteration)
        return entry

    def close(self) -> None:
        """Flush and close the TensorBoard writer (idempotent)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class GlobalModel:
    """The job's model for evaluation: a copy of ``model`` (made at the first call) whose
    parameters are ``strategy.global_weights_now()`` and whose buffers (batch-norm
    statistics) are ``model``'s own; calling it returns None where the strategy has no
    global weights. ``model`` itself is never touched (an update thread may be writing it)."""

    def __init__(self, model: nn.Module, strategy: Any) -> None:
        self.model, self.strategy = model, strategy
        self.read: Callable[[], torch.Tensor | None] = strategy.global_weights_now
        self.copy: nn.Module | None = None

    def __call__(self) -> nn.Module | None:
        flat = self.read()
        if flat is None:
            return None
        if self.copy is None:
            self.copy = copy.deepcopy(self.model)
        mine = dict(self.copy.named_parameters())
        names = {id(p): n for n, p in self.model.named_parameters()}
        with torch.no_grad():
            for name, buffer in self.model.named_buffers():
                self.copy.get_buffer(name).copy_(buffer)
            for param, view in zip(self.strategy.layout.params, self.strategy.layout.views(flat), strict=True):
                mine[names[id(param)]].copy_(view)
        return self.copy


class _Slices:
    """``(x, y)`` in batches of :data:`EVAL_BATCH`, iterable any number of times."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __iter__(self):
        for start in range(0, len(self.x), EVAL_BATCH):
            yield self.x[start : start + EVAL_BATCH], self.y[start : start + EVAL_BATCH]
