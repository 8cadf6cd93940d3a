"""Start N local workers (a small torchrun for one host) and watch them.

Each worker runs ``shmtrain.runtime.launch.worker`` with torchrun's environment variables, so
the worker code path is the same whether shmtrain or torchrun started it; it is forked
by the launcher's zygote, which imported torch once (``runtime/launch/zygote.py``), or, with
``SHMTRAIN_ZYGOTE=0``, started as a fresh ``python -m shmtrain.runtime.launch.worker``. The launcher makes
the job's private folder and its store, which listens nowhere (a FileStore in that
folder; for ``shmtrain run``'s scripts, which join by ``env://``, a TCPStore on loopback
alone, port chosen by the kernel: ``runtime/launch/job_dir.py``), and creates the host's
control block; when a worker dies it marks the failure there (waking every waiter), gives the others a moment to fail
with an error naming it, then terminates them. Ctrl-C and errors end every child, and
the run's shared-memory names are swept on every exit path, and what a worker started
ends with it (its process group, the orphans it left: ``runtime/launch/reaping.py``). With ``graceful_stop``
(``shmtrain train``), the first SIGINT or SIGTERM is relayed to the workers through the
control block's stop word instead: they finish the iteration, save a checkpoint and
return (``runtime/train/stop.py``); a second one ends them at once (SIGHUP too). With
``relay_signals`` (``shmtrain run``: scripts in their own sessions, as torchrun's) the
first signal is passed on to every worker instead, and they have :data:`STOP_GRACE_S`
seconds to end (to save what they want) before they are killed.

**Errors.** A worker that fails puts one line with its cause in the job's folder
(``error-<rank>``: the exception, and the peer it gave up waiting for when it timed
out); with ``log_dir`` each worker's stderr goes to ``log_dir/rank-<r>.log`` (the full
traceback), so the launcher's :class:`WorkerFailed` is one line naming the root cause:
the first worker to fail, or, when that one only timed out waiting for a peer, the peer
that stalled; with its signal name when a signal ended it.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shmtrain.fabric.shm.control import DIED, ControlBlock, process_state
from shmtrain.fabric.shm.segment import PREFIX, SharedSegment, sweep
from shmtrain.fabric.trust import bound_store
from shmtrain.runtime.launch import job_dir, reaping
from shmtrain.runtime.launch.deaths import DeathWait
from shmtrain.runtime.launch.failures import (
    WorkerFailed,
    describe_exit,
    error_record,
    exit_status,
    first_cause,
    root_cause,
    shm_note,
)
from shmtrain.runtime.launch.job_dir import JobDir
from shmtrain.runtime.launch.replacement import LAUNCHER_ENV, Budget, Replacer
from shmtrain.runtime.outputs.worker_logs import WorkerLogs

GRACE_S = 10.0
#: seconds the workers have to end after a relayed SIGINT/SIGTERM (torchrun's figure)
STOP_GRACE_S = 30.0


class StopNow(KeyboardInterrupt):
    """A stop that did not wait for the workers' checkpoint: a second SIGINT, SIGTERM or
    SIGHUP (``signum``; ``first`` the one that asked for the saving stop), or the signal
    reaching a worker before its training loop (``first`` 0)."""

    def __init__(self, signum: int, first: int = 0) -> None:
        super().__init__()
        self.signum, self.first = signum, first


def target_name(target: str | Callable[..., Any]) -> str:
    """``"module:function"`` of a worker target: a function (importable at the top of its
    module, as a fresh worker process finds it), or such a string as it is."""
    if isinstance(target, str):
        return target
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", "")
    if not module or not name or "<" in name or module == "__main__":
        raise ValueError(f"launch target {target!r}: a worker process imports its target by name, so it must "
                         "be a function defined at the top of an importable module (not __main__)")
    return f"{module}:{name}"


def launch(
    target: str | Callable[..., Any],
    nprocs: int,
    payload: Any = None,
    *,
    threads: int = 1,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    quiet_peers: bool = False,
    tolerate_worker_loss: bool = False,
    graceful_stop: bool = False,
    log_dir: Path | None = None,
    verbose: bool = False,
    relay_signals: bool = False,
    listen: bool = False,
    replace: Budget | None = None,
) -> list[Any]:
    """Run ``target`` (a function, or ``"module:function"``; called as ``fn(ctx, payload)``)
    in ``nprocs`` local worker processes; return their return values by rank. A fresh
    worker process imports the function by its module and name (:func:`target_name`).

    ``tolerate_worker_loss`` (asynchronous strategies, ``Strategy.tolerates_peer_loss``):
    a worker that dies after it started training (its control-block state word is
    non-zero) without reporting an error is recorded, not propagated; the others train
    on, and :class:`WorkerFailed` naming it (with ``.results`` of the survivors) is
    raised once they have finished.

    ``replace`` (``shmtrain train``, strategies that recover in place): a worker that
    dies without a report of its own is replaced in place while ``replace.left`` lasts,
    the others never exiting (``runtime/launch/replacement.py``).

    ``listen`` (``shmtrain run``): the job's store is a TCPStore on loopback, for workers
    that join by ``env://`` (``MASTER_ADDR``/``MASTER_PORT``); else a FileStore in the
    job's private folder, which no one else can reach.

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
    target = target_name(target)
    extra = {LAUNCHER_ENV: str(os.getpid())} if replace is not None else {}
    job = _JobSetup(nprocs, payload, threads=threads, timeout=timeout, env={**(env or {}), **extra}, listen=listen)
    children: list[Any] = []  # subprocess.Popen, or zygote.Worker (the same calls)
    logs = WorkerLogs(log_dir, nprocs, verbose)
    in_main = threading.current_thread() is threading.main_thread()  # signal handlers live there
    stopping = (_StopRelay(job.control, children if relay_signals else None)
                if (graceful_stop or relay_signals) and in_main else None)
    force = False
    try:
        for rank in range(nprocs):
            child_env = dict(job.env, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank), **logs.env())
            children.append(_start(target, child_env, (job.segment.fd, *logs.fds()), logs.path(rank),
                                   timeout))
        replacer = _replacer(target, job, replace, children, logs, timeout)
        supervisor = _Supervisor(children, job, logs, stopping, tolerate_worker_loss, replacer)
        job.closing.append(supervisor.close)
        supervisor.watch()
        return supervisor.results()
    except KeyboardInterrupt:
        force = stopping is not None  # a second signal: stop at once
        _end(children, 1.0 if force else 3.0, kill=force)
        raise
    finally:
        if stopping is not None:
            stopping.close()
        _end(children, 0.0, kill=force)
        logs.close()
        job.close()


def _replacer(target: str, job: _JobSetup, budget: Budget | None, children: list[Any], logs: WorkerLogs,
              timeout: float) -> Replacer | None:
    """The launch's :class:`Replacer` (None without a budget): it forks a replacement
    as the launch forks its workers, with the next generation's control block."""
    if budget is None:
        return None

    def fork(rank: int, env: dict[str, str]) -> Any:
        return _start(target, {**env, **logs.env()}, (int(env["SHMTRAIN_CONTROL_FD"]), *logs.fds()),
                      logs.path(rank), timeout)

    replacer = Replacer(job, budget, fork, children, timeout)
    job.closing.append(replacer.close)
    return replacer


class _JobSetup:
    """What a local launch sets up before any worker starts: its private folder (the
    payload and, later, every result and error report: ``runtime/launch/job_dir.py``),
    the job's store (a FileStore in that folder; with ``listen``, for scripts that join
    by ``env://``, a TCPStore on loopback alone), the host's control block (its name
    unlinked at once: the workers inherit the descriptor) and the workers' environment."""

    def __init__(self, nprocs: int, payload: Any, *, threads: int, timeout: float,
                 env: dict[str, str] | None, listen: bool = False) -> None:
        self.nprocs = nprocs
        run_id = secrets.token_hex(4)
        self.prefix = f"{PREFIX}-{run_id}"
        self.dir = JobDir.make()
        try:
            self.dir.put_payload(payload)
            if listen:
                self.store: dist.Store = bound_store("127.0.0.1", timeout=timeout, world_size=nprocs + 1)
                where = {"MASTER_PORT": str(self.store.port), "SHMTRAIN_STORE_PORT": str(self.store.port)}
            else:
                self.store = dist.FileStore(self.dir.store, -1)
                self.store.set_timeout(timedelta(seconds=timeout))
                where = {"SHMTRAIN_STORE_FILE": self.dir.store}
            self.store.set("run_id", run_id)
            self.segment = SharedSegment(f"{self.prefix}-h0-control", ControlBlock.nbytes(nprocs), create=True)
        except BaseException:
            self.dir.remove()
            raise
        self.control = ControlBlock(self.segment, nprocs, init=True)
        #: what else closes with the launch (a replacer's control blocks)
        self.closing: list[Callable[[], None]] = []
        # Workers inherit the descriptor, so the name can go at once: no window in which a
        # crash (or anyone sweeping /dev/shm) could leave or lose it.
        self.segment.unlink()
        self.env = dict(os.environ)
        self.env.update(env or {})
        self.env.update(
            WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
            SHMTRAIN_CONTROL=self.segment.name, SHMTRAIN_CONTROL_FD=str(self.segment.fd),
            SHMTRAIN_TIMEOUT=str(timeout), OMP_NUM_THREADS=str(threads), SHMTRAIN_THREADS=str(threads),
            **{job_dir.ENV: str(self.dir.path)}, **where,
        )
        for key in {"MASTER_PORT", "SHMTRAIN_STORE_PORT", "SHMTRAIN_STORE_FILE"} - where.keys():
            self.env.pop(key, None)  # an outer job's: not this one's

    def result(self, rank: int) -> Any:
        return self.dir.result(rank)

    def close(self) -> None:
        for close in self.closing:
            close()
        self.segment.unlink()
        sweep(self.prefix)
        del self.store
        self.dir.remove()


class _Supervisor:
    """The supervision policy of a local launch: poll the workers until every one has
    returned; the first to fail ends the others (its root cause named,
    :func:`~shmtrain.runtime.launch.failures.root_cause`);
    under ``tolerate_worker_loss`` a worker that dies after it started training is
    recorded and the others train on; under a graceful stop a worker ended by the signal
    before its loop ends the launch as a KeyboardInterrupt."""

    def __init__(self, children: list[Any], job: _JobSetup, logs: WorkerLogs,
                 stopping: _StopRelay | None, tolerate_worker_loss: bool, replacer: Replacer | None = None) -> None:
        self.children, self.job, self.logs, self.stopping = children, job, logs, stopping
        self.tolerate = tolerate_worker_loss
        self.replacer = replacer
        self.lost: dict[int, int] = {}  # tolerated deaths: rank -> exit code
        self._deaths = DeathWait()  # replacing in place: a death wakes the supervisor

    def watch(self) -> None:
        """Return once every worker has ended well (or was lost, tolerated); raise the
        first failure otherwise."""
        children, control = self.children, self.job.control
        while True:
            codes = [c.poll() for c in children]
            if self.stopping is not None and self.stopping.signum and self.stopping.children is not None:
                self.stopping.drain()  # a relayed signal: every worker ends, then StopNow
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0) and r not in self.lost]
            if bad and self.stopping is not None and self.stopping.signum and bad[0][1] in _STOP_CODES:
                _end(children, 3.0)  # the signal reached a worker before its loop: nothing saved
                raise StopNow(self.stopping.signum)
            if (bad and self.replacer is not None and not (self.stopping is not None and self.stopping.signum)
                    and control.aborted() in (None, (bad[0][0], DIED)) and self.replacer.curable(*bad[0])):
                rank, code = bad[0]
                pid = children[rank].pid
                block = self.replacer.replace(rank, code, control)
                if block is None:
                    raise self._failure(*first_cause(children, bad, self.lost))
                done = self.replacer.last["reports"].values()
                print(f"shmtrain: worker rank {rank} (pid {pid}) died ({describe_exit(code)}); replaced in place, "
                      f"the others going on from {min(done)}-{max(done)} steps done (replacement "
                      f"{self.replacer.budget.used}, {self.replacer.budget.left} left)", file=sys.stderr, flush=True)
                control = self.job.control = block  # the next generation's
                if self.stopping is not None:
                    self.stopping.control = block
                    if self.stopping.signum:  # asked for during the replacement: the new block says it
                        block.request_stop(self.stopping.signum)
                continue
            if bad and self.tolerate and control.aborted() is None and control.state(bad[0][0]) != 0:
                self.lost[bad[0][0]] = bad[0][1]
            elif bad:
                raise self._failure(*first_cause(children, bad, self.lost))
            if all(c == 0 or (c is not None and r in self.lost) for r, c in enumerate(codes)):
                return
            if self.replacer is None:
                time.sleep(0.05)
            else:  # replacing in place: a death ends the wait
                self._deaths.nap(self.children, 0.05)

    def close(self) -> None:
        self._deaths.close()

    def _failure(self, rank: int, code: int) -> WorkerFailed:
        self.job.control.abort(rank, exit_status(code))
        if self.replacer is not None:  # survivors waiting for a replacement fail at once instead
            self.replacer.give_up()
        zygote = _dead_zygote(self.children)
        if zygote is not None:  # not the worker's doing: its log is empty
            failure = WorkerFailed(zygote, rank, code)
            failure.zygote = True
            return failure
        record = error_record(self.job.dir, rank, code)
        stuck = _end(self.children, GRACE_S)
        failure = root_cause(self.children, rank, code, record, stuck, self.lost, self.logs, self.job.dir)
        failure.stop_signal = self.stopping.signum if self.stopping is not None else 0
        return failure

    def results(self) -> list[Any]:
        """Every worker's return value by rank; :class:`WorkerFailed` (with the survivors'
        ``.results``) when one was lost."""
        if self.lost:
            rank, code = next(iter(self.lost.items()))
            failure = WorkerFailed(
                f"worker rank {rank} (pid {self.children[rank].pid}) died: {describe_exit(code)}"
                f"{shm_note(code)}; the other workers trained on to the end", rank, code,
            )
            failure.results = {r: self.job.result(r) for r in range(self.job.nprocs) if r not in self.lost}
            raise failure
        return [self.job.result(r) for r in range(self.job.nprocs)]


#: exit codes of a worker ended by SIGINT or SIGTERM (its own status, or the signal's)
_STOP_CODES = (129, 130, 143, -signal.SIGHUP, -signal.SIGINT, -signal.SIGTERM)


class _StopRelay:
    """The launcher's SIGINT/SIGTERM/SIGHUP handlers under ``graceful_stop``: the first
    signal sets the control block's stop word, a second raises :class:`StopNow`. With
    ``children`` (``relay_signals``) the first is sent on to each of them instead."""

    def __init__(self, control: ControlBlock, children: list[Any] | None = None) -> None:
        self.control, self.children = control, children
        self.signum = 0
        self.at = 0.0
        self.sent: set[int] = set()  # pids the signal was sent to
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    def handle(self, signum: int, frame: Any) -> None:  # noqa: ARG002
        if self.signum:
            raise StopNow(signum, self.signum)
        self.signum, self.at = signum, time.monotonic()
        name = signal.Signals(signum).name
        if self.children is None:
            self.control.request_stop(signum)
            print(f"\nshmtrain: {name}: every worker finishes its iteration and "
                  "saves a checkpoint (Ctrl-C again to stop at once)", file=sys.stderr, flush=True)
            return
        self.forward()
        print(f"\nshmtrain: {name} passed on to every worker; they have {STOP_GRACE_S:.0f} s to end "
              "(Ctrl-C again to kill them at once)", file=sys.stderr, flush=True)

    def forward(self) -> None:
        """Send the signal to every worker that has not had it (one started since too)."""
        for child in list(self.children or ()):
            if child.pid not in self.sent:
                self.sent.add(child.pid)
                child.send_signal(self.signum)

    def drain(self) -> None:
        """After a relayed signal: wait for every worker to end (killing what is left after
        :data:`STOP_GRACE_S`), then raise :class:`StopNow`."""
        children = self.children or []
        while any(c.poll() is None for c in children) and time.monotonic() < self.at + STOP_GRACE_S:
            self.forward()
            time.sleep(0.05)
        _end(children, 0.0, kill=True)
        raise StopNow(self.signum)

    def close(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


#: environment variables that name an inherited file descriptor
_FD_KEYS = ("SHMTRAIN_CONTROL_FD", "SHMTRAIN_CONSOLE_FD")


def _start(target: str, env: dict[str, str], fds: tuple[int, ...], log: Path | None, timeout: float) -> Any:
    """One worker: forked by the zygote, or (``SHMTRAIN_ZYGOTE=0``) a fresh interpreter."""
    from shmtrain.runtime.launch import zygote

    if zygote.enabled():
        names = {str(fd): f"{{fd{i}}}" for i, fd in enumerate(fds)}
        env = {k: names.get(v, v) if k in _FD_KEYS else v for k, v in env.items()}
        try:  # importing torch takes seconds on a busy machine, whatever the peer --timeout
            return zygote.get(max(timeout, zygote.START_S)).spawn(env, [target], fds, str(log) if log else None)
        except RuntimeError as exc:
            raise WorkerFailed(f"worker rank {env.get('RANK')} could not be started: {exc}",
                               int(env.get("RANK", "0")), 1) from None
    stderr = open(log, "ab") if log else None  # noqa: SIM115 - the child holds it; ours closes below
    try:
        return subprocess.Popen([sys.executable, "-m", "shmtrain.runtime.launch.worker", target], env=env,
                                pass_fds=fds, stderr=stderr)
    finally:
        if stderr is not None:
            stderr.close()


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (state T in /proc), so it cannot exit
    (not ``t``: a tracer such as py-spy or strace stops it for a moment)."""
    return process_state(pid) == b"T"


def _end(children: list[Any], grace: float, kill: bool = False) -> list[int]:
    """Let children exit within ``grace`` seconds, then SIGTERM (``kill`` or a stopped child:
    SIGKILL), then SIGKILL; the ranks that had to be ended."""
    deadline = time.monotonic() + grace
    # a stopped child (SIGSTOP, a debugger) cannot exit on its own: no grace for it
    while grace and time.monotonic() < deadline and any(c.poll() is None and not _stopped(c.pid) for c in children):
        time.sleep(0.05)
    ended = [rank for rank, child in enumerate(children) if child.poll() is None]
    for rank in ended:
        if kill or _stopped(children[rank].pid):  # a SIGTERM would wait for a SIGCONT
            children[rank].kill()
        else:
            children[rank].terminate()
    deadline = time.monotonic() + 3.0
    for child in children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        if isinstance(child, subprocess.Popen):  # the zygote does this for the workers it forked
            reaping.kill_group(child.pid)
    return ended


def _dead_zygote(children: list[Any]) -> str | None:
    """The one-line cause when the zygote that forked ``children`` died (taking them with
    it); None when it lives, or when the workers were started without one."""
    zygote = getattr(children[0], "zygote", None) if children else None
    if zygote is None or zygote.alive():
        return None
    try:
        how = describe_exit(zygote.process.wait(2.0))
    except subprocess.TimeoutExpired:
        how = "it closed its socket"
    return (f"the worker zygote (pid {zygote.process.pid}, the process that forks the workers) died "
            f"({how}), and every worker ended with it; their logs say nothing of it (was it killed, "
            "or by the OOM killer: see dmesg?)")
