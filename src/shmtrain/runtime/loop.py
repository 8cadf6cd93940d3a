"""The worker loop of ``shmtrain train``: one process, one shard, one strategy.

Per iteration: next batch from the prefetch thread (``data``), then one
:meth:`shmtrain.runtime.trainer.Trainer.step` (``zero_grad``, ``forward``, ``backward``
with the gradient hooks inside, the strategy's communication and ``update``), then one
JSON line with the loss and the phase times. The loop ends when the strategy says so (its target
iterations, or a termination-alignment policy for asynchronous strategies).
"""

from __future__ import annotations

import json
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
from shmtrain.runtime.config import TrainConfig
from shmtrain.runtime.data import Dataset, Prefetcher, ShardSampler, load_data
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
    for start in range(0, len(x), batch):
        correct += int((model(x[start : start + batch]).argmax(1) == y[start : start + batch]).sum())
    model.train()
    return correct / max(1, len(x))


def train_worker(ctx: ProcessContext, payload: dict[str, Any]) -> dict[str, Any]:
    """Train this worker's shard; return its summary (rank 0 adds accuracy)."""
    config: TrainConfig = payload["config"]
    out = Path(payload["out"])
    torch.manual_seed(config.seed)
    data = load_data(config.data, input_shape=config.input_shape, samples=config.samples,
                     image_size=config.image_size)
    model = build_model(config.model, data.input_shape, data.num_classes)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )
    timer = PhaseTimer()
    dp = DataParallel(model, optimizer, config.strategy, config=config.strategy_config, ctx=ctx, timer=timer)
    trainer = Trainer(dp, nn.CrossEntropyLoss(), timer)
    total = planned_iterations(config, data, ctx.world_size)
    dp.strategy.target_iterations = total
    sampler = ShardSampler(len(data.train_x), config.batch_size, ctx.world_size, ctx.rank, config.seed)
    prefetch = Prefetcher(data.train_x, data.train_y, sampler, config.prefetch,
                          start=trainer.state.iteration)
    (out / "metrics").mkdir(parents=True, exist_ok=True)
    log = open(out / "metrics" / f"rank-{ctx.rank}.jsonl", "w")  # noqa: SIM115 - closed below
    progress = Progress(total, config.strategy, enabled=config.progress and ctx.rank == 0)
    start = time.perf_counter()
    losses: list[float] = []
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
            row = {"iteration": dp.strategy.iteration, "loss": value, "time": phases, **timer.take_details()}
            log.write(json.dumps(row) + "\n")
            progress.update(dp.strategy.iteration, value)
        progress.close()
        wall = time.perf_counter() - start
        dp.close()
    finally:
        prefetch.close()
        log.close()
    result: dict[str, Any] = {
        "rank": ctx.rank,
        "iterations": dp.strategy.iteration,
        "wall_s": wall,
        "final_loss": losses[-1] if losses else None,
        "planned_iterations": total,
    }
    if ctx.rank == 0:
        result["accuracy"] = accuracy(model, data.test_x, data.test_y)
        torch.save(model.state_dict(), out / "model.pt")
    return result


class Progress:
    """One self-rewriting line on stderr: iteration, loss, iterations per second."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total, self.label = total, label
        self.enabled = enabled and os.environ.get("SHMTRAIN_NO_PROGRESS") != "1"
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()
        self.last = 0.0

    def update(self, iteration: int, loss: float) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.last < (0.2 if self.tty else 5.0) and iteration < self.total:
            return
        self.last = now
        rate = iteration / max(now - self.start, 1e-9)
        width = 24
        done = min(width, int(width * iteration / max(self.total, 1)))
        line = (f"[{self.label}] [{'#' * done}{'.' * (width - done)}] {iteration}/{self.total} "
                f"loss {loss:.4f}  {rate:.1f} it/s")
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)
