"""Run ``shmtrain train``: start local workers, or be one worker of a torchrun job.

Long runs (issue items 2-4, 7): ``resume=True`` (``--resume RUN_DIR``) starts the workers
from the run's newest whole checkpoint (``runtime/checkpoint/checkpointer.py``); a worker's death
restarts every worker from the latest checkpoint up to ``--max-restarts`` times; a
Ctrl-C or SIGTERM makes the workers save and return, and :class:`RunStopped` carries the
exit status and how to continue. Under torchrun, a run folder that holds a checkpoint is
resumed by the workers themselves (torchrun's own ``--max-restarts`` restarts them).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from shmtrain import strategies
from shmtrain.fabric.control import PeerFailure, first_line
from shmtrain.runtime.checkpoint import files as checkpoint_files
from shmtrain.runtime.config import TrainConfig
from shmtrain.runtime.launch import failures, runlock, smb_server
from shmtrain.runtime.launch.launcher import WorkerFailed, launch
from shmtrain.runtime.launch.preflight import preflight
from shmtrain.runtime.launch.zygote import under_torchrun
from shmtrain.runtime.loop import train_worker
from shmtrain.runtime.outputs import report
from shmtrain.runtime.outputs.files import OutputError
from shmtrain.runtime.outputs.stretches import Stretch
from shmtrain.runtime.train import schedule
from shmtrain.startup import mark


def default_out(config: TrainConfig) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{config.strategy}"


class RunStopped(Exception):
    """The run stopped on request (Ctrl-C, SIGTERM); the message says what was saved and
    how to continue, ``code`` is the exit status (128 + the signal)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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
        return _run_torchrun(config, echo)
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
    start_from = _starting_point(out, config, resume)
    first_point = start_from
    if start_from is not None:
        _check_schedule(start_from, config, *schedule_check)
    checkpoint_files.prepare_run_folder(out, config)  # config.toml; refuses an unwritable folder
    echo(f"shmtrain: {config.strategy}, {config.workers} workers x {config.threads} thread(s), "
         f"{config.model} on {config.data}; run folder {out}"
         + (f"; resuming from {start_from.name}" if start_from else ""))
    start = time.perf_counter()
    restarts = 0
    while True:
        payload = {"config": config, "out": str(out), "resume": str(start_from) if start_from else None,
                   # --restart-schedule: on the checkpoint resumed from, not on one saved since
                   "restart_schedule": schedule_check[1] and start_from is not None and start_from == first_point}
        stretch = Stretch(out, (checkpoint_files.step_of(start_from) if start_from else None) or 0, config.workers)
        try:
            results = launch(train_worker, config.workers, payload, threads=config.threads, timeout=config.timeout,
                             # with restarts left, a death restarts the run instead (item 4)
                             tolerate_worker_loss=strategies.get(config.strategy).tolerates_peer_loss
                             and restarts >= config.max_restarts,
                             graceful_stop=True, log_dir=out / "logs", verbose=config.verbose,
                             env=_preload_env(config))
            break
        except WorkerFailed as exc:
            _end_stretch(stretch, "failed")  # its own failure (a full disk) must not hide the worker's
            if not exc.stop_signal and restarts < config.max_restarts:  # a dead zygote too: a new one forks
                restarts += 1
                start_from = checkpoint_files.resume_point(out, _warn)
                checkpoint_files.clean_partial(out)
                where = start_from if start_from else "the beginning (no checkpoint yet)"
                _warn(f"shmtrain: {exc}; restarting every worker from {where} "
                      f"(restart {restarts} of {config.max_restarts})")
                continue
            if exc.results and 0 in exc.results:
                # An asynchronous run lost a worker and the others trained to the end:
                # report what they did, then fail so the exit status says a worker died.
                _finish(out, config, list(exc.results.values()), time.perf_counter() - start, echo)
            if restarts:
                exc.args = (f"{exc} (after {restarts} restart(s), the last cause)",)
            if exc.zygote:
                exc.args = (f"{exc}; {_resume_hint(out)}",)
            raise
        except KeyboardInterrupt as exc:
            _end_stretch(stretch, "interrupted")
            signum = getattr(exc, "signum", signal.SIGINT)
            raise RunStopped(_interrupted_message(out, exc), 128 + signum) from None
    stopped = [r for r in results if r.get("stopped")]
    stretch.end("interrupted" if stopped else "finished", max(r["iterations"] for r in results))
    if stopped:
        raise RunStopped(_stopped_message(out, results, stopped[0]["stopped"]), 128 + stopped[0]["stopped"])
    return _finish(out, config, results, time.perf_counter() - start, echo)


def metric_text(summary: dict[str, Any]) -> str:
    """``held-out accuracy 97.50%``, or the task's metric (``held-out rmse 0.1234``)."""
    metric = summary.get("metric", "accuracy")
    value = summary.get(metric)
    if value is None:
        return f"held-out {metric} -"
    return f"held-out {metric} {value * 100:.2f}%" if metric == "accuracy" else f"held-out {metric} {value:.4g}"


def _end_stretch(stretch: Stretch, ended: str) -> None:
    """Record how a stretch ended while a failure or stop is being reported: a file that
    cannot be written then (the disk that failed the worker is full) is one warning line,
    and the report stays the worker's own (its rank and its log)."""
    try:
        stretch.end(ended)
    except OutputError as exc:
        _warn(f"shmtrain: warning: {exc}")


def _resume_hint(out: Path) -> str:
    last = checkpoint_files.latest(out)
    return (f"the latest complete checkpoint is {last}; continue with: shmtrain train --resume {out}"
            if last else f"no checkpoint was written; start again with --out {out}")


def _interrupted_message(out: Path, exc: KeyboardInterrupt) -> str:
    """What a stop that did not wait for the workers' checkpoint left: ``exc`` is a second
    signal (:class:`~shmtrain.runtime.launch.launcher.StopNow`: ``signum``, ``first``), or a
    Ctrl-C before the launcher's handlers were in place."""
    hint = _resume_hint(out)
    signum = getattr(exc, "signum", signal.SIGINT)
    name = signal.Signals(signum).name
    if getattr(exc, "first", 0):
        first = signal.Signals(exc.first).name  # type: ignore[attr-defined]
        return (f"stopped at once by a second signal ({name}, after {first}): every worker was ended "
                f"without waiting for the checkpoint of the stop; {hint}")
    return f"interrupted by {name} before the workers were training; every worker has been ended; {hint}"


def _starting_point(out: Path, config: TrainConfig, resume: bool) -> Path | None:
    """The checkpoint a local run starts from: the newest whole one with ``resume``
    (checked against ``config``); none for a new run, whose folder must hold none."""
    if not resume:
        existing = checkpoint_files.latest(out)
        if existing is not None:
            raise ValueError(
                f"--out {out} already holds a run with checkpoints ({existing}); continue it with: "
                f"shmtrain train --resume {out}, or give a new folder with --out"
            )
        return None
    found = checkpoint_files.complete_checkpoints(out)
    point = checkpoint_files.resume_point(out, _warn)
    if point is None:
        raise ValueError(_no_checkpoint(out, found))
    checkpoint_files.check_compatible(point, config)
    done = max(r["iteration"] for r in checkpoint_files.read_meta(point)["ranks"])
    if config.iterations is not None and config.iterations < done:
        raise ValueError(
            f"--iterations {config.iterations}: the run has done {done} iterations already "
            f"({point}); --iterations is the run's total, not the iterations to add: give "
            f"--iterations {done} or more"
        )
    return point


def _check_schedule(point: Path, config: TrainConfig, train_samples: int, restart: bool) -> None:
    """Refuse a resume to another length of a schedule drawn over the run's planned
    iterations (a finished cosine run extended would train at --lr-min), unless
    ``restart`` (``--restart-schedule``)."""
    from shmtrain.runtime.config import read_toml, resolve
    from shmtrain.runtime.loop import planned_iterations
    from shmtrain.runtime.train.schedule import extended_resume

    saved = resolve(read_toml(str(point / "config.toml")))
    facts = SimpleNamespace(train_samples=train_samples)
    planned = planned_iterations(saved, facts, config.workers)
    total = planned_iterations(config, facts, config.workers)
    done = max(r["iteration"] for r in checkpoint_files.read_meta(point)["ranks"])
    flag = f"--iterations {config.iterations}" if config.iterations is not None else f"--epochs {config.epochs:g}"
    problem = extended_resume(config, planned, done, total, flag)
    if problem is not None and not restart:
        raise ValueError(f"--resume {point.parent.parent}: {problem}")


def _no_checkpoint(out: Path, found: list[Path]) -> str:
    """Why ``--resume out`` has nothing to continue from (``found``: the complete
    checkpoints there before the resume looked at them)."""
    folder = out / checkpoint_files.CHECKPOINTS
    unfinished = sorted(p.name for p in folder.glob("step-*.tmp")) if folder.is_dir() else []
    if found:
        why = (f"every one was damaged ({', '.join(p.name for p in found)}: each named above and moved "
               "aside to step-<N>.corrupt)")
    elif unfinished:
        why = f"the run ended while writing its first one ({unfinished[0]} is unfinished)"
    else:
        why = "the run ended before its first one"
    return (f"--resume {out}: no complete checkpoint in {folder} ({why}); start the run again, in "
            "this folder or another --out")


def _stopped_message(out: Path, results: list[dict[str, Any]], signum: int) -> str:
    name = signal.Signals(signum).name
    its = sorted({r["iterations"] for r in results})
    at = f"iteration {its[0]}" if len(its) == 1 else f"iterations {its[0]}-{its[-1]}"
    saved = checkpoint_files.latest(out)
    return (f"interrupted by {name}: every worker stopped after {at} and saved {saved}; "
            f"continue with: shmtrain train --resume {out}")


def _finish(out: Path, config: TrainConfig, results: list[dict[str, Any]], wall: float, echo) -> dict[str, Any]:
    summary = report.summarize(out, config.to_dict(), results, wall)
    echo("\nTime per iteration (mean over workers and iterations):")
    echo(report.breakdown_table({k: v / 1e3 for k, v in summary["phases_ms"].items()}))
    for line in strategies.get(config.strategy).describe_metrics(summary):
        echo(line)
    runs = len(summary.get("stretches", [])) or 1
    echo(f"\n{metric_text(summary)}  |  {summary['iterations']} iterations  |  "
         f"wall {summary['wall_s']:.1f} s" + (f" in {runs} stretches (this one {wall:.1f} s)" if runs > 1 else "")
         + f"  |  {out}/summary.json, {out}/plot.png")
    if summary.get("early_stopped") is not None:
        echo(f"early stop (--early-stop {config.early_stop}) after iteration {summary['early_stopped']}")
    if summary.get("best"):
        best = summary["best"]
        echo(f"best held-out {best['metric']} {best['value']:.4g} at iteration {best['iteration']}: {out}/best.pt")
    if summary.get("lost_workers"):
        echo("lost during the run (the others trained to the end): " + ", ".join(
            f"rank {r} after iteration {n}" for r, n in summary["lost_workers"].items()))
    if summary.get("skipped_files"):
        echo(f"skipped {summary['skipped_files']} unreadable image(s) (--skip-bad-files); each is "
             f"named in {out}/logs/rank-0.log")
    if config.trace:
        echo(f"timeline: {out}/trace.json (open in https://ui.perfetto.dev or chrome://tracing)")
    if config.tensorboard:
        echo(f"TensorBoard: tensorboard --logdir {out}/tensorboard")
    return summary


def _run_torchrun(config: TrainConfig, echo) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    from shmtrain.fabric.context import from_env

    torch.set_num_threads(config.threads)
    start = time.perf_counter()
    mark("imports")
    if smb_server.wanted(config):  # rank 0 of an asynchronous job across hosts: its memory server
        smb_server.prefork(int(os.environ["WORLD_SIZE"]), config.timeout)  # forked now, no second torch import
    ctx = from_env(config.timeout)
    lock: runlock.RunLock | None = None  # rank 0 holds the run folder's lock for the job
    stretch: Stretch | None = None
    try:
        config.workers = ctx.world_size
        if ctx.rank == 0:
            info, lock = _torchrun_folder(config, echo)
            ctx.store.set("out", json.dumps(info))
        info = json.loads(ctx.store.get("out").decode())
        if info["error"]:
            raise ValueError(info["error"])
        out = Path(info["out"])
        mark("joined")
        if ctx.rank == 0:  # rank 0 records the job's stretch (stretches.py)
            stretch = Stretch(out, (checkpoint_files.step_of(info["resume"]) if info["resume"] else None) or 0)
        result = train_worker(ctx, {"config": config, "out": str(out), "resume": info["resume"]})
        if ctx.num_nodes > 1 and strategies.get(config.strategy).tolerates_host_loss:
            results = _gather_survivors(ctx, result)  # a lost host must not hang the others
            ctx.close()
        else:
            results = [None] * ctx.world_size
            dist.all_gather_object(results, result)
            ctx.shutdown()  # every peer done before any gloo pair is torn down (no exit abort)
    except BaseException as exc:
        ctx.fail()
        if stretch is not None:
            _end_stretch(stretch, "failed")
        lost = _lost_peers(ctx, exc)
        if lost is not None:
            raise lost from exc
        raise
    finally:
        ctx.close()
        if lock is not None:
            lock.release()
    stopped = [r for r in results if r.get("stopped")]
    if stretch is not None:
        stretch.end("interrupted" if stopped else "finished", max(r["iterations"] for r in results))
    if stopped:
        signum = stopped[0]["stopped"]
        raise RunStopped(_stopped_message(out, results, signum) if ctx.rank == 0 else "", 128 + signum)
    if ctx.rank != 0:
        return None
    return _finish(out, config, results, time.perf_counter() - start, echo)


def _lost_peers(ctx: Any, exc: BaseException) -> PeerFailure | None:
    """For a rank that fails under torchrun: its failure posted in the job's store; when it
    was a lost connection, the one-line error naming the peers that were lost by host and
    rank (those that never posted, :func:`~shmtrain.runtime.launch.failures.roll_call`), so
    the survivor is not blamed; None otherwise (the error stands as it is)."""
    cause = failures.short_cause(str(exc)) or first_line(exc)
    lost_connection = isinstance(exc, Exception) and failures.connection_lost(str(exc))
    try:
        missing = failures.roll_call(ctx.store, ctx.rank, ctx.world_size, cause,
                                     failures.ROLL_CALL_S if lost_connection else 0.0)
    except Exception:  # noqa: BLE001 - the store is gone with host 0
        if not lost_connection or ctx.node_rank == 0:
            return None
        return PeerFailure(f"host 0 ({os.environ.get('MASTER_ADDR')}), which holds the job's store, was lost "
                           f"(killed, or it went down; see its output); worker rank {ctx.rank} (host "
                           f"{ctx.node_rank}) only lost its connection to it ({cause})")
    if not lost_connection or not missing:
        return None
    return PeerFailure(failures.lost_peers_message(ctx.rank, ctx.local_world, missing, cause))


def _gather_survivors(ctx: Any, result: dict[str, Any]) -> list[dict[str, Any]]:
    """The workers' results through the job's store, without waiting for the lost ones.

    Every rank posts its result; rank 0 waits for those of every rank it does not know
    lost (its buffer service's board: ``result["lost"]``), within ``--timeout``, names
    the ranks that never answered as lost too, then posts ``results/done``, which the
    others wait for before tearing down their gloo pairs (the barrier of
    ``ProcessContext.shutdown``, which a dead peer would fail). Returns rank 0's list of
    results (the other ranks get theirs alone).
    """
    store = ctx.store
    if under_torchrun() and os.getppid() != _AGENT:  # its host's agent is gone (its workers are not)
        store.set(f"agent_gone/{ctx.rank}", "1")
    store.set(f"result/{ctx.rank}", pickle.dumps(result))
    deadline = time.monotonic() + ctx.timeout
    if ctx.rank != 0:
        while not store.check(["results/done"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        return [result]
    lost = {int(r): n for r, n in result.get("lost", {}).items()}
    results = [result]
    for rank in range(1, ctx.world_size):
        key = f"result/{rank}"
        while rank not in lost and not store.check([key]):
            if time.monotonic() > deadline:
                lost[rank] = -1  # never answered: its last iteration comes from its metrics
                break
            time.sleep(0.05)
        if rank not in lost:
            results.append(pickle.loads(store.get(key)))
    result["lost"] = lost
    store.set("results/done", "1")
    _check_in_for_lost_hosts(ctx, lost)
    return results


#: torchrun's agents meet at an exit barrier under this key (its prefix in the agent's store)
_AGENT_EXIT_BARRIER = "torchelastic/agent/terminal_state"
#: under torchrun, this worker's parent when it started: its host's agent
_AGENT = os.getppid()


def _check_in_for_lost_hosts(ctx: Any, lost: dict[int, int]) -> None:
    """Let this host's torchrun agent leave: torchrun's agents wait for one another at an
    exit barrier (300 s, which the command line cannot change) that a lost host's agent
    never reaches (it failed, or died). Once every worker of a host is known lost, or
    found its agent gone (the agent alone was killed), rank 0 checks in for that host's
    agent, as the agent itself would have on finishing."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    gone = [r for r in range(ctx.world_size) if r in lost or ctx.store.check([f"agent_gone/{r}"])]
    hosts = [n for n in range(ctx.num_nodes)
             if all(r in gone for r in range(n * ctx.local_world, (n + 1) * ctx.local_world))]
    if not run_id or not hosts or os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return
    import datetime

    import torch.distributed as dist

    try:
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=datetime.timedelta(seconds=10))
        agents = dist.PrefixStore(run_id, base)
        for _ in hosts:
            if agents.add(f"{_AGENT_EXIT_BARRIER}/num_members", 1) == ctx.num_nodes:
                agents.set(f"{_AGENT_EXIT_BARRIER}/last_member", "<val_ignored>")
    except (RuntimeError, KeyError, ValueError) as exc:
        _warn(f"shmtrain: could not let torchrun's agent leave early ({exc}); it waits for the lost "
              "host(s) at its exit barrier (300 s), then exits")


def _torchrun_folder(config: TrainConfig, echo) -> tuple[dict[str, Any], runlock.RunLock | None]:
    """Rank 0 of a torchrun job: the run folder, locked (the lock is returned: rank 0
    holds it for the job; a restart by torchrun's ``--max-restarts`` follows a rank 0 that
    died, so the lock is free again), and the checkpoint to resume from when the folder
    holds one (a restart, or the same command run again); an error message instead when
    that cannot be."""
    out = Path(config.out) if config.out else default_out(config)
    lock = None
    try:
        lock = runlock.acquire(out, resume=out.is_dir() and checkpoint_files.latest(out) is not None)
        point = checkpoint_files.resume_point(out, _warn) if out.is_dir() else None
        if point is not None:
            checkpoint_files.check_compatible(point, config)
            if schedule.depends_on_length(config):  # no silent lr --lr-min over an extended run
                from shmtrain.runtime.tasks import task_of
                from shmtrain.runtime.tasks.data import open_run_data

                _check_schedule(point, config, open_run_data(config, task_of(config)).train_samples, False)
            echo(f"shmtrain: resuming {out} from {point.name} (torchrun restart "
                 f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')})")
        checkpoint_files.prepare_run_folder(out, config)
    except ValueError as exc:
        if lock is not None:
            lock.release()
        return {"out": None, "resume": None, "error": str(exc)}, None
    return {"out": str(out.resolve()), "resume": str(point.resolve()) if point else None, "error": None}, lock
