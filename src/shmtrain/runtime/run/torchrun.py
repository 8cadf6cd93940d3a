"""``shmtrain train`` as one worker of a torchrun job: the run folder agreed between
hosts, the worker trained, the survivors' results gathered, a lost host named and the
agent's exit barrier checked in for it (docs/hosts.md)."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path
from typing import Any

from shmtrain import strategies
from shmtrain.fabric.job.context import under_torchrun
from shmtrain.fabric.shm.control import PeerFailure, first_line
from shmtrain.runtime.checkpoint import files as checkpoint_files
from shmtrain.runtime.config import TrainConfig
from shmtrain.runtime.defaults import settle
from shmtrain.runtime.launch import failures, runlock, smb_server
from shmtrain.runtime.launch.open_files import ensure_open_files
from shmtrain.runtime.outputs.stretches import Stretch
from shmtrain.runtime.run.end import RunStopped, end_stretch, finish, stopped_message, warn
from shmtrain.runtime.run.loop import train_worker
from shmtrain.runtime.run.start import check_schedule, default_out
from shmtrain.runtime.train import schedule
from shmtrain.startup import mark


def run_torchrun(config: TrainConfig, echo) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    from shmtrain.fabric.job.context import from_env

    torch.set_num_threads(config.threads)
    start = time.perf_counter()
    mark("imports")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ensure_open_files(world, f"torchrun's job of {world} workers")  # ulimit -n, before any socket
    if smb_server.wanted(config):  # rank 0 of an asynchronous job across hosts: its memory server
        smb_server.prefork(int(os.environ["WORLD_SIZE"]), config.timeout)  # forked now, no second torch import
    ctx = from_env(config.timeout)
    lock: runlock.RunLock | None = None  # rank 0 holds the run folder's lock for the job
    stretch: Stretch | None = None
    try:
        config.workers = ctx.world_size
        config = settle(config, ctx.num_nodes)  # the defaults of the job's setting (runtime/defaults.py)
        if ctx.rank == 0:
            info, lock = torchrun_folder(config, echo)
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
            results = gather_survivors(ctx, result)  # a lost host must not hang the others
            ctx.close()
        else:
            results = [None] * ctx.world_size
            dist.all_gather_object(results, result)
            ctx.shutdown()  # every peer done before any gloo pair is torn down (no exit abort)
    except BaseException as exc:
        # the roll call first: this host's other workers end as soon as this rank's failure is
        # posted, and torchrun then stops this rank before it could name the lost host
        lost = lost_peers(ctx, exc)
        ctx.fail()
        if stretch is not None:
            end_stretch(stretch, "failed")
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
        raise RunStopped(stopped_message(out, results, signum) if ctx.rank == 0 else "", 128 + signum)
    if ctx.rank != 0:
        return None
    return finish(out, config, results, time.perf_counter() - start, echo)

def lost_peers(ctx: Any, exc: BaseException) -> PeerFailure | None:
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

def encode_result(result: dict[str, Any]) -> bytes:
    """A worker's result for torchrun's store, in a format that cannot run code when read:
    ``torch.save`` read back with ``weights_only=True`` (tensors, numbers, strings,
    lists, tuples and dicts only; anyone who reaches the store across hosts can write it)."""
    import torch

    buffer = io.BytesIO()
    torch.save(result, buffer)
    return buffer.getvalue()


def decode_result(data: bytes, rank: int) -> dict[str, Any]:
    """:func:`encode_result`'s bytes back; one line naming the rank when they are not a
    result of that format (someone else wrote the key)."""
    import torch

    try:
        result = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever the bytes are, they are refused
        raise PeerFailure(f"worker rank {rank}'s result in torchrun's store is not one a worker writes "
                          f"({first_line(exc, 120)}): refused unread; someone else can write that store "
                          "(run the job on a network only its hosts reach: docs/security.md)") from None
    if not isinstance(result, dict):
        raise PeerFailure(f"worker rank {rank}'s result in torchrun's store is a {type(result).__name__}, "
                          "not a worker's result: refused (docs/security.md)")
    return result


def gather_survivors(ctx: Any, result: dict[str, Any]) -> list[dict[str, Any]]:
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
    store.set(f"result/{ctx.rank}", encode_result(result))
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
            results.append(decode_result(store.get(key), rank))
    result["lost"] = lost
    store.set("results/done", "1")
    check_in_for_lost_hosts(ctx, lost)
    return results

#: torchrun's agents meet at an exit barrier under this key (its prefix in the agent's store)
_AGENT_EXIT_BARRIER = "torchelastic/agent/terminal_state"

#: under torchrun, this worker's parent when it started: its host's agent
_AGENT = os.getppid()

def check_in_for_lost_hosts(ctx: Any, lost: dict[int, int]) -> None:
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
        warn(f"shmtrain: could not let torchrun's agent leave early ({exc}); it waits for the lost "
              "host(s) at its exit barrier (300 s), then exits")

def torchrun_folder(config: TrainConfig, echo) -> tuple[dict[str, Any], runlock.RunLock | None]:
    """Rank 0 of a torchrun job: the run folder, locked (the lock is returned: rank 0
    holds it for the job; a restart by torchrun's ``--max-restarts`` follows a rank 0 that
    died, so the lock is free again), and the checkpoint to resume from when the folder
    holds one (a restart, or the same command run again); an error message instead when
    that cannot be."""
    out = Path(config.out) if config.out else default_out(config)
    lock = None
    try:
        lock = runlock.acquire(out, resume=out.is_dir() and checkpoint_files.latest(out) is not None)
        point = checkpoint_files.resume_point(out, warn) if out.is_dir() else None
        if point is not None:
            checkpoint_files.check_compatible(point, config)
            if schedule.depends_on_length(config):  # no silent lr --lr-min over an extended run
                from shmtrain.runtime.tasks import task_of
                from shmtrain.runtime.tasks.data import open_run_data

                check_schedule(point, config, open_run_data(config, task_of(config)).train_samples, False)
            echo(f"shmtrain: resuming {out} from {point.name} (torchrun restart "
                 f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')})")
        checkpoint_files.prepare_run_folder(out, config)
    except ValueError as exc:
        if lock is not None:
            lock.release()
        return {"out": None, "resume": None, "error": str(exc)}, None
    return {"out": str(out.resolve()), "resume": str(point.resolve()) if point else None, "error": None}, lock
