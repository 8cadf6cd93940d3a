"""Run ``shmtrain train``: start local workers, or be one worker of a torchrun job
(``runtime/run/torchrun.py``); where a run starts is ``runtime/run/start.py``, how it ends
and what it says ``runtime/run/end.py``.

Long runs: ``resume=True`` (``--resume RUN_DIR``) starts the workers
from the run's newest whole checkpoint (``runtime/checkpoint/checkpointer.py``); a worker's death
restarts every worker from the latest checkpoint up to ``--max-restarts`` times; a
Ctrl-C or SIGTERM makes the workers save and return, and :class:`RunStopped` carries the
exit status and how to continue. Under torchrun, a run folder that holds a checkpoint is
resumed by the workers themselves (torchrun's own ``--max-restarts`` restarts them).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from pathlib import Path
from typing import Any

from shmtrain import strategies
from shmtrain.fabric.job.context import under_torchrun
from shmtrain.runtime.checkpoint import files as checkpoint_files
from shmtrain.runtime.config import TrainConfig
from shmtrain.runtime.defaults import settle
from shmtrain.runtime.launch import runlock
from shmtrain.runtime.launch.launcher import WorkerFailed, launch
from shmtrain.runtime.launch.preflight import preflight
from shmtrain.runtime.launch.replacement import Budget
from shmtrain.runtime.outputs.stretches import Stretch
from shmtrain.runtime.run.end import (
    RunStopped,
    end_stretch,
    finish,
    interrupted_message,
    resume_hint,
    stopped_message,
    warn,
)
from shmtrain.runtime.run.loop import train_worker
from shmtrain.runtime.run.start import check_schedule, default_out, starting_point
from shmtrain.runtime.run.torchrun import run_torchrun


def uses_torchvision(model: str, data: str) -> bool:
    """Whether the workers of a run of ``model`` on ``data`` import torchvision (one of its
    models, or an image folder: ImageFolder and its transforms)."""
    from shmtrain.models.registry import needs_torchvision
    from shmtrain.runtime.data.kinds import kind_of

    return needs_torchvision(model) or kind_of(data).torchvision

def _preload_env(config: TrainConfig) -> dict[str, str]:
    """What the zygote should import once before forking this run's workers."""
    from shmtrain.runtime.launch.zygote import PRELOAD_ENV

    return {PRELOAD_ENV: "torchvision"} if uses_torchvision(config.model, config.data) else {}

def _import_matplotlib() -> None:
    """Import the plotting library while the workers train (the plot is drawn at the end)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except ImportError:
        pass

def recovers_in_place(config: TrainConfig) -> bool:
    """Whether a worker of this run that dies is replaced in place (the others never
    exit): restarts allowed, on CPU, and a strategy that recovers so
    (``Strategy.recovery``): as a replica, with an allreduce whose sums do not depend on
    timing (not ``auto``, which times its candidates again in a new generation), or as
    an asynchronous one whose W_g is on this host (not on a ``--smb-server``)."""
    import torch

    on_cpu = config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available())
    options = config.strategy_config
    mode = config.plan.strategy.recovery
    fits = ((mode == "replica" and getattr(options, "allreduce", None) != "auto")
            or (mode == "elastic" and not getattr(options, "smb_server", "")))
    return config.max_restarts > 0 and on_cpu and fits


def _clean_partial(out: Path) -> None:
    """Remove the unfinished checkpoints of a launch that failed or was stopped (never read,
    but litter); a folder that cannot be cleaned keeps them, the run's own error stands."""
    with contextlib.suppress(OSError):
        checkpoint_files.clean_partial(out)


def run_training(config: TrainConfig, echo=print, *, resume: bool = False,
                 restart_schedule: bool = False) -> dict[str, Any] | None:
    """Train as ``config`` says; return the summary (None on non-zero ranks of torchrun).

    ``resume``: continue the run in ``config.out`` from its newest whole checkpoint
    (``config`` comes from :func:`shmtrain.runtime.checkpoint.files.resume_config`).
    ``restart_schedule`` (``--restart-schedule``, with ``resume``): a new learning-rate
    schedule over the iterations left instead of the checkpoint's; a resume to another
    length of a schedule drawn over the run's length is refused without it
    (:func:`shmtrain.runtime.train.schedule.extended_resume`).

    Raises:
        ValueError: bad input, before any worker starts (exit status 2).
        WorkerFailed: a worker failed (after ``config.max_restarts`` restarts).
        RunStopped: stopped by Ctrl-C or SIGTERM (after saving a checkpoint when it could).
    """
    if restart_schedule and not resume:
        raise ValueError("--restart-schedule: it restarts the learning-rate schedule of a resumed run; use it "
                         "with --resume RUN_DIR, or leave it out")
    if under_torchrun():
        return run_torchrun(config, echo)
    config = settle(config, 1)  # one host: the defaults of its setting (runtime/defaults.py)
    from shmtrain.runtime.launch import zygote

    zygote.prestart()  # imports torch for the workers while the launcher checks the input
    threading.Thread(target=_import_matplotlib, name="shmtrain-plot-import", daemon=True).start()
    out = Path(config.out) if config.out else default_out(config)
    facts = preflight(config, out)  # before any folder or worker: one clear line, exit 2
    with runlock.acquire(out, resume=resume):  # one run per folder, before anything is written
        return _run_local(config, out, echo, resume, (facts.train_samples, restart_schedule))

def _run_local(config: TrainConfig, out: Path, echo, resume: bool,
               schedule_check: tuple[int, bool] = (0, False)) -> dict[str, Any]:
    """The local launch of :func:`run_training`, in a run folder this process has locked
    (``schedule_check``: the training samples and ``--restart-schedule``)."""
    start_from = starting_point(out, config, resume)
    first_point = start_from
    if start_from is not None:
        check_schedule(start_from, config, *schedule_check)
    checkpoint_files.prepare_run_folder(out, config)  # config.toml; refuses an unwritable folder
    echo(f"shmtrain: {config.strategy}, {config.workers} workers x {config.threads} thread(s), "
         f"{config.model} on {config.data}; run folder {out}"
         + (f"; resuming from {start_from.name}" if start_from else ""))
    start = time.perf_counter()
    restarts = 0
    # --max-restarts is also the budget of workers replaced in place (runtime/launch/replacement.py)
    replacing = Budget(config.max_restarts) if recovers_in_place(config) else None
    while True:
        payload = {"config": config, "out": str(out), "resume": str(start_from) if start_from else None,
                   # --restart-schedule: on the checkpoint resumed from, not on one saved since
                   "restart_schedule": schedule_check[1] and start_from is not None and start_from == first_point}
        stretch = Stretch(out, (checkpoint_files.step_of(start_from) if start_from else None) or 0, config.workers)
        try:
            results = launch(train_worker, config.workers, payload, threads=config.threads, timeout=config.timeout,
                             # with restarts left, a death restarts the run instead
                             tolerate_worker_loss=strategies.get(config.strategy).tolerates_peer_loss
                             and restarts >= config.max_restarts,
                             graceful_stop=True, log_dir=out / "logs", verbose=config.verbose,
                             env=_preload_env(config), replace=replacing)
            break
        except WorkerFailed as exc:
            end_stretch(stretch, "failed")  # its own failure (a full disk) must not hide the worker's
            if exc.diverged and config.max_restarts:  # the same data and weights would diverge again
                last = checkpoint_files.latest(out)
                exc.args = (f"{exc} (not restarted: a restart from {last or 'the beginning'} would meet the same "
                            "divergence; every checkpoint written is finite)",)
                raise
            if replacing is not None:  # what replacements spent comes off the restarts
                restarts, replacing.used = restarts + replacing.used, 0
            if not exc.stop_signal and restarts < config.max_restarts:  # a dead zygote too: a new one forks
                restarts += 1
                if replacing is not None:
                    replacing.left = config.max_restarts - restarts
                start_from = checkpoint_files.resume_point(out, warn)
                checkpoint_files.clean_partial(out)
                where = start_from if start_from else "the beginning (no checkpoint yet)"
                warn(f"shmtrain: {exc}; restarting every worker from {where} "
                      f"(restart {restarts} of {config.max_restarts})")
                continue
            if exc.results and 0 in exc.results:
                # An asynchronous run lost a worker and the others trained to the end:
                # report what they did, then fail so the exit status says a worker died.
                finish(out, config, list(exc.results.values()), time.perf_counter() - start, echo)
            if restarts:
                exc.args = (f"{exc} (after {restarts} restart(s), the last cause)",)
            if exc.zygote:
                exc.args = (f"{exc}; {resume_hint(out)}",)
            _clean_partial(out)  # a checkpoint the failure cut short (every worker has ended)
            raise
        except KeyboardInterrupt as exc:
            end_stretch(stretch, "interrupted")
            _clean_partial(out)
            signum = getattr(exc, "signum", signal.SIGINT)
            raise RunStopped(interrupted_message(out, exc), 128 + signum) from None
    stopped = [r for r in results if r.get("stopped")]
    stretch.end("interrupted" if stopped else "finished", max(r["iterations"] for r in results))
    if stopped:
        raise RunStopped(stopped_message(out, results, stopped[0]["stopped"]), 128 + stopped[0]["stopped"])
    return finish(out, config, results, time.perf_counter() - start, echo)
