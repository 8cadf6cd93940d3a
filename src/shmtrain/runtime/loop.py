"""The worker loop of ``shmtrain train``: one process, one shard, one strategy.

Per iteration: next batch from the prefetch thread (``data``), then one
:meth:`shmtrain.runtime.trainer.Trainer.step` (``zero_grad``, ``forward``, ``backward``
with the gradient hooks inside, the strategy's communication and ``update``, then the
learning-rate scheduler), then one JSON line with the loss, the learning rate it used
(``lr``), its start (``t0``, seconds since the epoch) and the phase times; then, outside
the iteration, rank 0's held-out evaluation when due and its TensorBoard scalars
(``runtime/monitor.py``). The loop ends when the strategy says so (its target
iterations, or a termination-alignment policy for asynchronous strategies).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shmtrain.api import DataParallel
from shmtrain.fabric.context import ProcessContext
from shmtrain.models import build_model
from shmtrain.runtime import schedule
from shmtrain.runtime.checkpoint import Checkpointer
from shmtrain.runtime.config import TrainConfig
from shmtrain.runtime.data import Dataset, Prefetcher, ShardSampler, load_data
from shmtrain.runtime.device import worker_device
from shmtrain.runtime.files import save_output
from shmtrain.runtime.finite import check_loss, json_text
from shmtrain.runtime.monitor import Monitor
from shmtrain.runtime.stop import StopRequest
from shmtrain.runtime.trainer import Trainer
from shmtrain.timing import PhaseTimer


def planned_iterations(config: TrainConfig, data: Dataset, world: int) -> int:
    """Iterations per worker: ``--iterations``, or ``--epochs`` over the sharded data."""
    if config.iterations is not None:
        return config.iterations
    steps = len(data.train_x) // (config.batch_size * world)
    epochs = config.epochs if config.epochs is not None else 20
    return max(1, round(epochs * max(steps, 1)))


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 256) -> float:
    model.eval()
    correct = 0
    device = next(model.parameters()).device
    for start in range(0, len(x), batch):
        xb, yb = x[start : start + batch].to(device), y[start : start + batch].to(device)
        correct += int((model(xb).argmax(1) == yb).sum())
    model.train()
    return correct / max(1, len(x))


def build_optimizer(config: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer of the run, from the config's optimisation section (SGD with
    momentum and weight decay: the papers' optimizer)."""
    return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                           weight_decay=config.weight_decay)


def _build(ctx: ProcessContext, config: TrainConfig) -> tuple[Any, torch.device, nn.Module, DataParallel,
                                                              Trainer, PhaseTimer, int]:
    """This worker's data, device, model, DataParallel, Trainer, timer and planned
    iterations."""
    torch.manual_seed(config.seed)
    data = load_data(config.data, input_shape=config.input_shape, samples=config.samples,
                     image_size=config.image_size, skip_bad_files=config.skip_bad_files)
    device = worker_device(config.device, ctx.host.local_rank)  # GPU local_rank % count, or the CPU
    model = build_model(config.model, data.input_shape, data.num_classes).to(device)
    optimizer = build_optimizer(config, model)
    timer = PhaseTimer(device)  # on a GPU: forward, backward, update timed by CUDA events
    dp = DataParallel(model, optimizer, config.strategy, config=config.strategy_config, ctx=ctx, timer=timer)
    total = planned_iterations(config, data, ctx.world_size)
    trainer = Trainer(dp, nn.CrossEntropyLoss(), timer, scheduler=schedule.from_config(optimizer, config, total),
                      sub_batch=config.sub_batch, amp=config.amp)  # --sub-batch K: K threads per worker (SUB-BATCH)
    dp.target_iterations = total
    return data, device, model, dp, trainer, timer, total


def train_worker(ctx: ProcessContext, payload: dict[str, Any]) -> dict[str, Any]:
    """Train this worker's shard; return its summary (rank 0 adds accuracy)."""
    config: TrainConfig = payload["config"]
    out = Path(payload["out"])
    data, device, model, dp, trainer, timer, total = _build(ctx, config)
    # checkpoints (runtime/checkpoint.py): a resumed run loads every rank's state here,
    # collectively, before the data position is used
    checkpoints = Checkpointer(ctx, config, out, len(data.train_x) // (config.batch_size * ctx.world_size))
    checkpoints.restore(trainer, payload.get("resume"))
    sampler = ShardSampler(len(data.train_x), config.batch_size, ctx.world_size, ctx.rank, config.seed)
    prefetch = Prefetcher(data.train_x, data.train_y, sampler, config.prefetch,
                          start=trainer.state.iteration)
    log = checkpoints.open_metrics(out / "metrics" / f"rank-{ctx.rank}.jsonl", trainer.state.iteration)
    progress = Progress(total, config.strategy, enabled=config.progress and ctx.rank == 0,
                        first=trainer.state.iteration)
    monitor = Monitor(config, out, ctx.rank, model, data, ctx.world_size)  # rank 0: eval, TensorBoard
    start = time.perf_counter()
    losses: list[float] = []
    stop = StopRequest(ctx)  # Ctrl-C / SIGTERM: finish the iteration, save, end (runtime/stop.py)
    first = trainer.state.iteration
    try:
        while not dp.should_stop():
            iter_start = time.perf_counter()
            with timer.phase("data"):
                x, y = prefetch.next()
            loss = trainer.step(x, y)
            phases = timer.finish_iteration()
            phases["iteration"] = time.perf_counter() - iter_start
            value = float(loss.detach())
            losses.append(value)
            row = {"iteration": dp.iteration, "loss": value, "lr": trainer.lr,
                   "t0": monitor.stamp(iter_start), "time": phases, **timer.take_details()}
            log.write(json_text(row) + "\n")  # NaN/inf as null, flagged (runtime/finite.py)
            check_loss(value, dp.iteration, ctx.rank, trainer.lr)
            monitor.after_iteration(row, log)  # outside the iteration's time
            progress.update(dp.iteration, value)
            if stop.check(dp.iteration):
                break
            if checkpoints.due(dp.iteration, total):
                log.flush()  # rows up to the checkpoint are on disk before it is
                checkpoints.save(trainer, dp.iteration)
        stop.finished(dp.iteration)
        if dp.iteration > first:  # a finished run resumed at its total has its last eval row
            monitor.finish(dp.iteration, log)
        progress.close()
        wall = time.perf_counter() - start
        log.flush()
        saved = checkpoints.save_final(trainer, stop.target if stop.stopped else total)
        dp.close()
    finally:
        trainer.close()
        stop.close()
        prefetch.close()
        monitor.close()
        log.close()
    result: dict[str, Any] = {
        "rank": ctx.rank,
        "iterations": dp.iteration,
        "wall_s": wall,
        "final_loss": losses[-1] if losses else None,
        "planned_iterations": total,
        "trained": dp.iteration - first,  # this launch's iterations (0: nothing left to do)
        # a stop (Ctrl-C, SIGTERM): its signal and the checkpoint the run continues from
        "stopped": stop.signum if stop.stopped else 0,
        "checkpoint": str(saved) if saved is not None else None,
        "skipped_files": data.skipped,
        # asynchronous strategies: workers lost during the run (rank -> iterations done)
        "lost": dp.lost_peers,
        "device": str(device),
    }
    if ctx.rank == 0 and not stop.stopped:
        result["accuracy"] = accuracy(model, data.test_x, data.test_y)
        save_output(out / "model.pt", model.state_dict())
    return result


def console() -> Any:
    """Where the progress line goes: the launcher's terminal (``SHMTRAIN_CONSOLE_FD``,
    since this worker's own stderr goes to its log file), else stderr."""
    fd = os.environ.get("SHMTRAIN_CONSOLE_FD")
    if fd:
        try:
            return open(int(fd), "w", closefd=False)  # noqa: SIM115 - the launcher owns the descriptor
        except (OSError, ValueError):
            pass
    return sys.stderr


class Progress:
    """One self-rewriting line on the terminal: iteration, loss, iterations per second."""

    def __init__(self, total: int, label: str, enabled: bool, first: int = 0) -> None:
        self.total, self.label = total, label
        self.enabled = enabled and os.environ.get("SHMTRAIN_NO_PROGRESS") != "1"
        self.stream = console() if self.enabled else sys.stderr
        self.tty = self.stream.isatty()
        self.start = time.perf_counter()
        self.first = first  # a resumed run's starting iteration (for the rate)
        self.last = 0.0

    def update(self, iteration: int, loss: float) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.last < (0.2 if self.tty else 5.0) and iteration < self.total:
            return
        self.last = now
        rate = (iteration - self.first) / max(now - self.start, 1e-9)
        width = 24
        done = min(width, int(width * iteration / max(self.total, 1)))
        line = (f"[{self.label}] [{'#' * done}{'.' * (width - done)}] {iteration}/{self.total} "
                f"loss {loss:.4f}  {rate:.1f} it/s")
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=self.stream, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=self.stream)
