"""Start N local workers (a small torchrun for one host) and watch them.

Each worker is a fresh ``python -m shmtrain.runtime.worker`` process with torchrun's
environment variables, so the worker code path is the same whether shmtrain or
torchrun started it. The launcher hosts the TCPStore on loopback (port chosen by the
kernel: no port races) and creates the host's control block; when a worker dies it
marks the failure there (waking every waiter), gives the others a moment to fail
with an error naming it, then terminates them. Ctrl-C and errors end every child, and
the run's shared-memory names are swept on every exit path. With ``graceful_stop``
(``shmtrain train``), the first SIGINT or SIGTERM is relayed to the workers through the
control block's stop word instead: they finish the iteration, save a checkpoint and
return (``runtime/stop.py``); a second one ends them at once.
"""

from __future__ import annotations

import os
import pickle
import secrets
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from shmtrain.fabric.control import ControlBlock
from shmtrain.fabric.segment import PREFIX, SharedSegment, sweep

GRACE_S = 10.0


class WorkerFailed(RuntimeError):
    """A worker exited with an error; ``rank`` and ``returncode`` say which and how."""

    def __init__(self, message: str, rank: int, returncode: int) -> None:
        super().__init__(message)
        self.rank = rank
        self.returncode = returncode
        #: the signal of a stop under way when it failed (0: none); no restart after a stop
        self.stop_signal = 0
        #: the survivors' return values by rank, when a tolerated loss let them finish
        self.results: dict[int, Any] | None = None


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def launch(
    target: str,
    nprocs: int,
    payload: Any = None,
    *,
    threads: int = 1,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    quiet_peers: bool = False,
    tolerate_worker_loss: bool = False,
    graceful_stop: bool = False,
) -> list[Any]:
    """Run ``target`` (``"module:function"``, called as ``fn(ctx, payload)``) in ``nprocs``
    local worker processes; return their return values by rank.

    ``tolerate_worker_loss`` (asynchronous strategies, ``Strategy.tolerates_peer_loss``):
    a worker that dies after it started training (its control-block state word is
    non-zero) without reporting an error is recorded, not propagated; the others train
    on, and :class:`WorkerFailed` naming it (with ``.results`` of the survivors) is
    raised once they have finished.

    ``graceful_stop`` (``shmtrain train``; from the main thread): the launcher's first
    SIGINT or SIGTERM sets the stop word of the control block, which the workers read
    after each iteration: they agree on an iteration, save a checkpoint there and return
    normally. A second signal ends them at once (SIGKILL after 1 s) and raises
    KeyboardInterrupt; so does a worker that exits 130 or 143 during the stop (one the
    signal reached before its training loop).

    Raises:
        WorkerFailed: a worker exited non-zero (the first one to fail is named).
        KeyboardInterrupt: on Ctrl-C, after every worker has been ended.
    """
    if nprocs < 1:
        raise ValueError(f"--workers {nprocs}: at least 1 worker is needed")
    run_id = secrets.token_hex(4)
    prefix = f"{PREFIX}-{run_id}"
    store = dist.TCPStore(
        "127.0.0.1", 0, nprocs + 1, is_master=True, timeout=timedelta(seconds=timeout),
        wait_for_workers=False,
    )
    store.set("run_id", run_id)
    store.set("payload", pickle.dumps(payload))
    control_segment = SharedSegment(f"{prefix}-h0-control", ControlBlock.nbytes(nprocs), create=True)
    control = ControlBlock(control_segment, nprocs, init=True)
    # Workers inherit the descriptor, so the name can go at once: no window in which a
    # crash (or anyone sweeping /dev/shm) could leave or lose it.
    control_segment.unlink()
    base_env = dict(os.environ)
    base_env.update(env or {})
    base_env.update(
        WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs), GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), SHMTRAIN_STORE_PORT=str(store.port),
        SHMTRAIN_CONTROL=control_segment.name, SHMTRAIN_CONTROL_FD=str(control_segment.fd),
        SHMTRAIN_TIMEOUT=str(timeout),
        OMP_NUM_THREADS=str(threads), SHMTRAIN_THREADS=str(threads),
    )
    children: list[subprocess.Popen] = []
    failure: WorkerFailed | None = None
    in_main = threading.current_thread() is threading.main_thread()  # signal handlers live there
    stopping = _StopRelay(control) if graceful_stop and in_main else None
    force = False
    try:
        for rank in range(nprocs):
            child_env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank))
            children.append(
                subprocess.Popen([sys.executable, "-m", "shmtrain.runtime.worker", target], env=child_env,
                                 pass_fds=(control_segment.fd,))
            )
        lost: dict[int, int] = {}  # tolerated deaths: rank -> exit code
        while True:
            codes = [c.poll() for c in children]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0) and r not in lost]
            if bad and stopping is not None and stopping.signum and bad[0][1] in _STOP_CODES:
                _end(children, 3.0)  # the signal reached a worker before its loop: nothing saved
                raise KeyboardInterrupt
            if bad and failure is None and tolerate_worker_loss and control.aborted() is None \
                    and control.state(bad[0][0]) != 0:
                lost[bad[0][0]] = bad[0][1]
            elif bad and failure is None:
                rank, code = bad[0]
                control.abort(rank, code if code > 0 else 128 - code)
                failure = WorkerFailed(
                    f"worker rank {rank} (pid {children[rank].pid}) failed: {describe_exit(code)}"
                    + "".join(f" (after worker rank {r} died: {describe_exit(c)})" for r, c in lost.items()),
                    rank, code,
                )
                failure.stop_signal = stopping.signum if stopping is not None else 0
                _end(children, GRACE_S)
                break
            if all(c == 0 or (c is not None and r in lost) for r, c in enumerate(codes)):
                break
            time.sleep(0.05)
        if failure is not None:
            raise failure
        if lost:
            rank, code = next(iter(lost.items()))
            failure = WorkerFailed(
                f"worker rank {rank} (pid {children[rank].pid}) died: {describe_exit(code)}; "
                "the other workers trained on to the end", rank, code,
            )
            failure.results = {
                r: pickle.loads(store.get(f"result/{r}")) for r in range(nprocs) if r not in lost
            }
            raise failure
        return [pickle.loads(store.get(f"result/{r}")) for r in range(nprocs)]
    except KeyboardInterrupt:
        force = stopping is not None  # a second signal: stop at once
        _end(children, 1.0 if force else 3.0, kill=force)
        raise
    finally:
        if stopping is not None:
            stopping.close()
        _end(children, 0.0, kill=force)
        control_segment.unlink()
        sweep(prefix)
        del store


#: exit codes of a worker ended by SIGINT or SIGTERM (its own status, or the signal's)
_STOP_CODES = (130, 143, -signal.SIGINT, -signal.SIGTERM)


class _StopRelay:
    """The launcher's SIGINT/SIGTERM handlers under ``graceful_stop``: the first signal
    sets the control block's stop word, a second raises KeyboardInterrupt."""

    def __init__(self, control: ControlBlock) -> None:
        self.control = control
        self.signum = 0
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def handle(self, signum: int, frame: Any) -> None:  # noqa: ARG002
        if self.signum:
            raise KeyboardInterrupt
        self.signum = signum
        self.control.request_stop(signum)
        print(f"\nshmtrain: {signal.Signals(signum).name}: every worker finishes its iteration and "
              "saves a checkpoint (Ctrl-C again to stop at once)", file=sys.stderr, flush=True)

    def close(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def _end(children: list[subprocess.Popen], grace: float, kill: bool = False) -> None:
    """Let children exit within ``grace`` seconds, then SIGTERM (``kill``: SIGKILL), then
    SIGKILL."""
    deadline = time.monotonic() + grace
    while grace and time.monotonic() < deadline and any(c.poll() is None for c in children):
        time.sleep(0.05)
    for child in children:
        if child.poll() is None:
            if kill:
                child.kill()
            else:
                child.terminate()
    deadline = time.monotonic() + 3.0
    for child in children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
