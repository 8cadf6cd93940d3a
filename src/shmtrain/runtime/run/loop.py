"""The worker of ``shmtrain train``: one process, one shard, one strategy.

:func:`train_worker` (the launcher's target: ``runtime/run/training.py`` passes this function)
opens a :class:`WorkerSession`, which builds this worker's task (``runtime/tasks/``),
data, model, optimizer (:func:`build_optimizer`, from the config's optimisation section),
:class:`shmtrain.parallel.data_parallel.DataParallel` and :class:`shmtrain.runtime.train.trainer.Trainer`,
restores a checkpoint, opens what the run keeps around its iterations (checkpointer, stop
request, monitor, metrics file, progress line:
:class:`shmtrain.runtime.train.trainer.RunServices`) and hands them to
:meth:`Trainer.train`, which runs the loop (per iteration: the next batch from the
prefetch thread, one step, one JSON line, rank 0's evaluation when due, a checkpoint when
due). The session owns every object that needs closing, in one ``ExitStack``: they close
on every exit path, the loop's own as soon as the loop ends, the held-out loader after the
final evaluation. It returns this worker's summary.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shmtrain.fabric.job.context import ProcessContext
from shmtrain.models import build_model
from shmtrain.parallel.data_parallel import DataParallel
from shmtrain.runtime.checkpoint import files as checkpoint_files
from shmtrain.runtime.checkpoint.checkpointer import Checkpointer
from shmtrain.runtime.config import TrainConfig
from shmtrain.runtime.data.class_split import shard_sampler
from shmtrain.runtime.data.loader import HeldOut, open_batches
from shmtrain.runtime.data.sources import write_run_facts
from shmtrain.runtime.files import save_output
from shmtrain.runtime.outputs.progress import Progress
from shmtrain.runtime.outputs.selection import Selection
from shmtrain.runtime.run import recovery
from shmtrain.runtime.run.monitor import Monitor, evaluate_batches
from shmtrain.runtime.tasks.data import open_run_data, write_task_facts
from shmtrain.runtime.tasks.lookup import task_of
from shmtrain.runtime.train import schedule
from shmtrain.runtime.train.device import worker_device
from shmtrain.runtime.train.finite import json_text
from shmtrain.runtime.train.optimizers import build_optimizer
from shmtrain.runtime.train.stop import StopRequest
from shmtrain.runtime.train.trainer import RunServices, Trainer, TrainOutcome
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


def rejoin_position(trainer: Trainer, iteration: int) -> None:
    """A rejoining worker goes on at ``iteration`` (its strategy's, from the memory
    server's board): the data position, and the learning-rate schedule stepped as far
    (its optimizer's momentum starts afresh)."""
    trainer.state.iteration = iteration
    if trainer.scheduler is not None:
        for _ in range(iteration):
            schedule.step_scheduler(trainer.scheduler)


class WorkerSession:
    """What one worker of ``shmtrain train`` builds, and the one place it is closed.

    ``with WorkerSession(ctx, payload) as session: return session.run()``: :meth:`run`
    builds (:meth:`_build`), restores, trains and returns the summary; every object that
    needs closing is pushed on :attr:`stack` as it is made (the loop's services on
    :attr:`loop`, a stack inside it, closed when the loop ends), so any exception, at
    any point, closes what exists and nothing else.
    """

    def __init__(self, ctx: ProcessContext, payload: dict[str, Any], recovered: dict[str, Any] | None = None,
                 replacement: bool = False) -> None:
        self.ctx = ctx
        #: the state a worker continues from after a peer was replaced in place
        #: (``runtime/run/recovery.py``), instead of a checkpoint; ``replacement``: this
        #: process is the one forked in place of the dead worker (the donor's state)
        self.recovered = recovered
        self.replacement = replacement
        #: this rank's state when a peer's death ended the loop (recovering in place)
        self.kept: dict[str, Any] | None = None
        #: the strategy could not make this rank's state whole (``Strategy.recovery_state``)
        self.unkept = False
        self.config: TrainConfig = payload["config"]
        self.out = Path(payload["out"])
        self.resume: str | None = payload.get("resume")
        self.restart_schedule = bool(payload.get("restart_schedule"))
        self.stack = ExitStack()
        #: the loop's services (trainer threads, prefetch, metrics file, monitor, stop)
        self.loop = ExitStack()
        self.task = task_of(self.config)

    def __enter__(self) -> WorkerSession:
        self.stack.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stack.__exit__(*exc)

    def _build(self) -> None:
        """This worker's data (``runtime/data/sources.py``, through the task), device, model,
        DataParallel, Trainer, timer and planned iterations."""
        ctx, config = self.ctx, self.config
        torch.manual_seed(config.seed)
        self.data = open_run_data(config, self.task)
        mark("data")
        self.device = worker_device(config.device, ctx.host.local_rank)  # GPU local_rank % count, or the CPU
        self.model = build_model(config.model, self.data.input_shape, self.data.num_classes,
                                 config.model_args).to(self.device)
        mark("model")
        optimizer = build_optimizer(config, self.model.parameters())  # --optimizer (runtime/train/optimizers.py)
        self.timer = PhaseTimer(self.device)  # on a GPU: forward, backward, update timed by CUDA events
        self.dp = DataParallel(self.model, optimizer, config.strategy, config=config.strategy_config, ctx=ctx,
                               timer=self.timer, grad_clip=config.grad_clip, plan=config.plan)
        mark("strategy")
        self.total = planned_iterations(config, self.data, ctx.world_size)
        # --sub-batch K: K threads per worker (SUB-BATCH)
        self.trainer = Trainer(self.dp, self.task, self.timer,
                               scheduler=schedule.from_config(optimizer, config, self.total),
                               sub_batch=config.sub_batch, amp=config.amp, accumulate=config.accumulate)
        self.loop.callback(self.trainer.close)
        if config.defaults_taken:  # the first metrics row says which defaults the setting chose
            self.trainer.first_row = {"defaults": list(config.defaults_taken)}
        self.dp.target_iterations = self.total

    def _open(self) -> RunServices:
        """Restore the checkpoint, then open the loop's services (each pushed to close)."""
        ctx, config, out, data = self.ctx, self.config, self.out, self.data
        if ctx.rank == 0:  # classes.json, and the data's facts in config.toml (runtime/data/sources.py)
            if self.task.takes_builtin_data:
                write_run_facts(out, data)
            else:
                write_task_facts(out, data, self.task)
        # checkpoints (runtime/checkpoint/checkpointer.py): a resumed run loads every rank's state here,
        # collectively, before the data position is used
        checkpoints = Checkpointer(ctx, config, out, data.train_samples // (config.batch_size * ctx.world_size),
                                   lost=self.dp.lost_now)  # a lost rank's last state is carried on
        rejoined = getattr(ctx, "rejoined", False)
        if self.recovered is not None:  # the run's first row (the defaults it took) is long written
            self.trainer.first_row = {}
        if self.recovered is not None and self.replacement and not self.recovered[recovery.DONOR]["replica"]:
            # replacing an asynchronous worker: its own fresh state, then W_g and the dead one's count
            state, steps = recovery.elastic_start(self.trainer, self.recovered,
                                                  out / "metrics" / f"rank-{ctx.rank}.jsonl")
            self.trainer.load_state_dict(state)
            self.dp.strategy.take_global_weights(steps)
            rejoin_position(self.trainer, steps)
            self.recovered = state
        elif self.recovered is not None:  # a peer replaced in place: the state every rank continues from
            state = self.dp.strategy.adopted_state(recovery.with_global_weights(self.recovered), recovery.folder())
            self.trainer.load_state_dict(state)
            if ctx.rank == 0:  # a checkpoint the death interrupted (no rank saves before the next step)
                checkpoint_files.clean_partial(out)
        elif rejoined:  # a host started again: the job's state, not a file's
            rejoin_position(self.trainer, self.dp.iteration)
        else:
            checkpoints.restore(self.trainer, self.resume)
        start = self.trainer.state.iteration
        if self.restart_schedule and self.recovered is None:  # --restart-schedule: a new schedule
            self.trainer.scheduler = schedule.restart(self.dp.optimizer, config, self.total - start)
        sampler = shard_sampler(data, config.batch_size, config.seed, ctx, config.class_split)  # --class-split
        # the shard's batches from the run's position on (runtime/data/loader.py): a thread slicing
        # tensors, or DataLoader processes decoding a folder / module:callable data
        self.prefetch = open_batches(data, sampler, config, self.device, start=start)
        self.loop.callback(self.prefetch.close)  # the loader processes end on every exit path
        # rank 0's persistent evaluation processes: open until the final evaluation is done
        self.held_out = HeldOut(data, (config.loader_workers or 0) if ctx.rank == 0 else 0,
                                self.device.type == "cuda", limit=config.eval_samples)  # --eval-samples
        self.stack.callback(self.held_out.close)
        metrics = out / "metrics" / f"rank-{ctx.rank}.jsonl"
        log = checkpoints.open_metrics(metrics, start, keep=rejoined, tail=self.recovered is not None)
        self.loop.callback(log.close)
        if self.recovered is not None:  # a peer replaced in place: the rows up to the step every rank goes on from
            log.flush()
            for row in recovery.catch_up_rows(self.recovered, metrics, time.time()):
                log.write(json_text(row) + "\n")
        progress = Progress(self.total, config.strategy, enabled=config.progress and ctx.rank == 0, first=start)
        self.stop = StopRequest(ctx)  # Ctrl-C / SIGTERM: finish the iteration, save, end (runtime/train/stop.py)
        # an asynchronous worker is not held by a peer's death: it looks for the launcher's abort
        self.stop.watch_abort = recovery.elastic(self.dp.strategy)
        recovery.prepare(self.dp.strategy)  # gpi: the root journals each step's state from here
        self.loop.callback(self.stop.close)
        # --keep-best, --early-stop (runtime/outputs/selection.py): rank 0, after each evaluation
        selection = Selection(out, self.task, config.keep_best, config.early_stop, self.stop.request_early)
        monitor = Monitor(config, out, ctx.rank, self.model, data, ctx.world_size, self.held_out,
                          self.dp.strategy, task=self.task, selection=selection)  # rank 0: eval, TensorBoard
        self.loop.callback(monitor.close)
        self.monitor = monitor
        return RunServices(checkpoints, self.stop, monitor, log, progress, ctx.rank)

    def run(self) -> dict[str, Any]:
        """Build, restore, train; this worker's summary."""
        self.stack.enter_context(self.loop)  # closed at the latest with the session
        self._build()
        services = self._open()
        mark("first-iteration")  # what follows is the loop (its first row's t0)
        try:
            outcome = self.trainer.train(self.prefetch.next, services, self.total)
        except recovery.PEER_LOSS:
            mark("recover-stopped")
            if recovery.enabled(self.dp.strategy):  # the launcher replaces the dead peer: keep the state
                self.kept = recovery.keep(self.trainer)
                mark("recover-copied")
                self.unkept = self.kept is None  # no whole state: this worker ends, the job restarts
            raise
        self.dp.close()
        self.loop.close()
        return self._result(outcome)

    def _result(self, outcome: TrainOutcome) -> dict[str, Any]:
        """This worker's summary; rank 0 adds the held-out metrics (``accuracy`` for
        classification) and writes ``model.pt``."""
        ctx, dp, stop, model = self.ctx, self.dp, self.stop, self.model
        result: dict[str, Any] = {
            "rank": ctx.rank,
            "iterations": dp.iteration,
            "wall_s": outcome.wall_s,
            "final_loss": outcome.final_loss,
            "planned_iterations": self.total,
            "trained": outcome.trained,  # this launch's iterations (0: nothing left to do)
            # a stop (Ctrl-C, SIGTERM): its signal and the checkpoint the run continues from
            "stopped": stop.signum if stop.stopped and not stop.early else 0,
            # --early-stop: the iteration the run stopped at (it counts as finished)
            "early_stopped": dp.iteration if stop.stopped and stop.early else None,
            "checkpoint": str(outcome.checkpoint) if outcome.checkpoint is not None else None,
            "skipped_files": self.data.skipped,
            # asynchronous strategies: workers lost during the run (rank -> iterations done)
            "lost": dp.lost_peers,
            "device": str(self.device),
            "task": self.task.name,
            "metric": self.task.primary,
        }
        if ctx.rank == 0 and (not stop.stopped or stop.early):
            primary = self.task.primary
            global_state = dp.global_state_dict()  # asynchronous strategies: W_g is the job's model
            if global_state is not None:
                result[f"{primary}_rank0_local"] = self.task.evaluate(model, self.held_out)[primary]
                save_output(self.out / "model-rank0.pt", model.state_dict())
                with torch.no_grad():
                    model.load_state_dict(global_state)
                result["model"] = "global weights (W_g); rank 0's own in model-rank0.pt"
            last = self.monitor
            if global_state is None and last.last_eval == dp.iteration and not last.last_was_global:
                metrics = dict(last.last_metrics or {})  # the model the final evaluation row has: not again
            else:
                metrics = self.task.evaluate(model, self.held_out)
            result["metrics"] = metrics
            result[primary] = metrics[primary]
            save_output(self.out / "model.pt", model.state_dict())
        return result


def train_worker(ctx: ProcessContext, payload: dict[str, Any]) -> dict[str, Any]:
    """Train this worker's shard; return its summary (rank 0 adds the held-out metrics).

    A peer's death that the launcher replaces in place ends the session, not the worker:
    it joins the job's next generation with the replacement (``runtime/run/recovery.py``)
    and trains on in a new session from the state every rank continues from."""
    recovered = recovery.replacement_state()  # a replacement: the donor's state
    replacement = recovered is not None
    replaced, spent = 0, 0.0
    while True:
        session = WorkerSession(ctx, payload, recovered, replacement)
        replacement = False
        began = time.perf_counter()
        try:
            with session:
                result = session.run()
        except recovery.PEER_LOSS as exc:
            # a death before this session trained (the replacement's, during the set-up after a
            # recovery): this rank's state is still the one it was to continue from
            kept = session.kept if session.kept is not None or session.replacement else recovered
            if kept is None or session.unkept:
                raise
            failure: BaseException = exc
        else:
            result["wall_s"] += spent  # the whole run's, its recoveries included
            result["replaced_peers"] = replaced
            return result
        session = None
        recovered = recovery.recover(ctx, kept, failure)
        replaced += 1
        spent += time.perf_counter() - began
