"""The worker of ``shmtrain train``: one process, one shard, one strategy.

:func:`train_worker` builds this worker's data, model, optimizer (:func:`build_optimizer`,
from the config's optimisation section), :class:`shmtrain.api.DataParallel` and
:class:`shmtrain.runtime.train.trainer.Trainer`, restores a checkpoint, opens what the run
keeps around its iterations (checkpointer, stop request, monitor, metrics file, progress
line: :class:`shmtrain.runtime.train.trainer.RunServices`) and hands them to
:meth:`Trainer.train`, which runs the loop (per iteration: the next batch from the
prefetch thread, one step, one JSON line, rank 0's evaluation when due, a checkpoint when
due). It closes them on every exit path and returns this worker's summary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from shmtrain.api import DataParallel
from shmtrain.fabric.context import ProcessContext
from shmtrain.models import build_model
from shmtrain.runtime.checkpoint.checkpointer import Checkpointer
from shmtrain.runtime.config import TrainConfig
from shmtrain.runtime.data.class_split import shard_sampler
from shmtrain.runtime.data.loader import HeldOut, open_batches
from shmtrain.runtime.data.sources import DataSource, open_data, write_run_facts
from shmtrain.runtime.outputs.files import save_output
from shmtrain.runtime.outputs.monitor import Monitor, evaluate_batches
from shmtrain.runtime.outputs.progress import Progress
from shmtrain.runtime.train import schedule
from shmtrain.runtime.train.device import worker_device
from shmtrain.runtime.train.optimizers import build_optimizer
from shmtrain.runtime.train.stop import StopRequest
from shmtrain.runtime.train.trainer import RunServices, Trainer
from shmtrain.startup import mark
from shmtrain.timing import PhaseTimer


def planned_iterations(config: TrainConfig, data: Any, world: int) -> int:
    """Iterations per worker: ``--iterations``, or ``--epochs`` over the sharded data
    (``data.train_samples`` training samples)."""
    if config.iterations is not None:
        return config.iterations
    steps = data.train_samples // (config.batch_size * world)
    epochs = config.epochs if config.epochs is not None else 20
    return max(1, round(epochs * max(steps, 1)))


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 256) -> float:
    """Held-out accuracy of ``model`` on tensors ``(x, y)``."""
    return evaluate_batches(model, ((x[s : s + batch], y[s : s + batch]) for s in range(0, len(x), batch)))[1]


def _build(ctx: ProcessContext, config: TrainConfig) -> tuple[DataSource, torch.device, nn.Module, DataParallel,
                                                              Trainer, PhaseTimer, int]:
    """This worker's data (``runtime/data/sources.py``), device, model, DataParallel, Trainer,
    timer and planned iterations."""
    torch.manual_seed(config.seed)
    data = open_data(config)
    mark("data")
    device = worker_device(config.device, ctx.host.local_rank)  # GPU local_rank % count, or the CPU
    model = build_model(config.model, data.input_shape, data.num_classes, config.model_args).to(device)
    mark("model")
    optimizer = build_optimizer(config, model.parameters())  # --optimizer (runtime/train/optimizers.py)
    timer = PhaseTimer(device)  # on a GPU: forward, backward, update timed by CUDA events
    dp = DataParallel(model, optimizer, config.strategy, config=config.strategy_config, ctx=ctx, timer=timer,
                      grad_clip=config.grad_clip)
    mark("strategy")
    total = planned_iterations(config, data, ctx.world_size)
    trainer = Trainer(dp, nn.CrossEntropyLoss(), timer, scheduler=schedule.from_config(optimizer, config, total),
                      sub_batch=config.sub_batch, amp=config.amp, accumulate=config.accumulate)  # --sub-batch K: K threads per worker (SUB-BATCH)
    dp.target_iterations = total
    return data, device, model, dp, trainer, timer, total


def rejoin_position(trainer: Trainer, iteration: int) -> None:
    """A rejoining worker goes on at ``iteration`` (its strategy's, from
    the memory server's board): the data position, and the learning-rate schedule stepped
    as far (its optimizer's momentum starts afresh)."""
    trainer.state.iteration = iteration
    if trainer.scheduler is not None:
        for _ in range(iteration):
            schedule.step_scheduler(trainer.scheduler)


def train_worker(ctx: ProcessContext, payload: dict[str, Any]) -> dict[str, Any]:
    """Train this worker's shard; return its summary (rank 0 adds accuracy)."""
    config: TrainConfig = payload["config"]
    out = Path(payload["out"])
    data, device, model, dp, trainer, timer, total = _build(ctx, config)
    if ctx.rank == 0:  # classes.json, and the data's facts in config.toml (runtime/data/sources.py)
        write_run_facts(out, data)
    # checkpoints (runtime/checkpoint/checkpointer.py): a resumed run loads every rank's state here,
    # collectively, before the data position is used
    checkpoints = Checkpointer(ctx, config, out, data.train_samples // (config.batch_size * ctx.world_size))
    if getattr(ctx, "rejoined", False):  # a host started again: the job's state, not a file's
        rejoin_position(trainer, dp.iteration)
    else:
        checkpoints.restore(trainer, payload.get("resume"))
    sampler = shard_sampler(data, config.batch_size, config.seed, ctx, config.class_split)  # --class-split
    # the shard's batches from the run's position on (runtime/data/loader.py): a thread slicing
    # tensors, or DataLoader processes decoding a folder / module:callable data
    prefetch = open_batches(data, sampler, config, device, start=trainer.state.iteration)
    held_out = HeldOut(data, (config.loader_workers or 0) if ctx.rank == 0 else 0, device.type == "cuda")
    log = checkpoints.open_metrics(out / "metrics" / f"rank-{ctx.rank}.jsonl", trainer.state.iteration,
                                   keep=getattr(ctx, "rejoined", False))
    progress = Progress(total, config.strategy, enabled=config.progress and ctx.rank == 0,
                        first=trainer.state.iteration)
    monitor = Monitor(config, out, ctx.rank, model, data, ctx.world_size, held_out, dp.strategy)  # rank 0: eval, TensorBoard
    stop = StopRequest(ctx)  # Ctrl-C / SIGTERM: finish the iteration, save, end (runtime/train/stop.py)
    mark("first-iteration")  # what follows is the loop (its first row's t0)
    try:
        outcome = trainer.train(prefetch.next, RunServices(checkpoints, stop, monitor, log, progress, ctx.rank), total)
        dp.close()
    except BaseException:
        held_out.close()
        raise
    finally:
        trainer.close()
        stop.close()
        prefetch.close()  # the loader processes end here on every exit path
        monitor.close()
        log.close()
    try:
        return _result(ctx, out, data, model, dp, outcome, stop, total, str(device), held_out)
    finally:
        held_out.close()  # rank 0's persistent evaluation processes


def _result(ctx: ProcessContext, out: Path, data: DataSource, model: nn.Module, dp: DataParallel, outcome: Any,
            stop: StopRequest, total: int, device: str, held_out: HeldOut) -> dict[str, Any]:
    """This worker's summary; rank 0 adds the held-out accuracy and writes ``model.pt``."""
    result: dict[str, Any] = {
        "rank": ctx.rank,
        "iterations": dp.iteration,
        "wall_s": outcome.wall_s,
        "final_loss": outcome.final_loss,
        "planned_iterations": total,
        "trained": outcome.trained,  # this launch's iterations (0: nothing left to do)
        # a stop (Ctrl-C, SIGTERM): its signal and the checkpoint the run continues from
        "stopped": stop.signum if stop.stopped else 0,
        "checkpoint": str(outcome.checkpoint) if outcome.checkpoint is not None else None,
        "skipped_files": data.skipped,
        # asynchronous strategies: workers lost during the run (rank -> iterations done)
        "lost": dp.lost_peers,
        "device": device,
    }
    if ctx.rank == 0 and not stop.stopped:
        global_state = dp.global_state_dict()  # asynchronous strategies: W_g is the job's model
        if global_state is not None:
            result["accuracy_rank0_local"] = evaluate_batches(model, held_out)[1]
            save_output(out / "model-rank0.pt", model.state_dict())
            with torch.no_grad():
                model.load_state_dict(global_state)
            result["model"] = "global weights (W_g); rank 0's own in model-rank0.pt"
        result["accuracy"] = evaluate_batches(model, held_out)[1]
        save_output(out / "model.pt", model.state_dict())
    return result
