"""Fast worker start: one process imports torch once, and forks every worker.

Every worker used to be a fresh ``python -m shmtrain.runtime.launch.worker``, which spends
~2.3 s of CPU importing torch before it does anything; N workers on 2 cores waited
~N x 1.2 s. The zygote is a child of the launcher that imports torch and shmtrain's
worker path once (and the digits data set; torchvision only when a worker's environment
asks for it, :data:`PRELOAD_ENV`), runs nothing (so it holds no thread pool and no lock a fork
could copy half-taken), and forks a worker per request: the fork costs milliseconds,
and the workers share the imported pages copy-on-write.

Protocol, over a ``SOCK_SEQPACKET`` socket pair (one message per datagram):

- launcher -> zygote: ``{"env", "argv", "cwd", "log", "fds"}`` with file descriptors
  attached (``SCM_RIGHTS``): the launcher's stdout and stderr, then those the worker
  must inherit (the control block, the console); the zygote forks, and the child
  takes the launcher's environment, folder, stdout/stderr (or ``log``), renames itself
  ``shmtrain-w<rank>`` (``/proc/<pid>/comm``) and runs :func:`shmtrain.runtime.launch.worker.main`;
- zygote -> launcher: ``{"pid"}`` for each fork, ``{"exit": pid, "code"}`` when a worker
  ends (``code`` as :attr:`subprocess.Popen.returncode`: negative for a signal).

What a worker starts ends with it: the zygote kills a worker's process group when it
ends (a ``shmtrain run`` script's worker leads its own) and, as the subreaper of every
worker's descendants (``PR_SET_CHILD_SUBREAPER``), kills the orphans they left once no
worker is live (the children of a ``shmtrain train`` worker, a daemonized fork): none
keeps the launcher's stdout open (``shmtrain run ... | tail`` ends with the run).

The zygote is started on a process's first :func:`spawn` and lives as long as that
process (it dies with it: ``PR_SET_PDEATHSIG``; and the launcher closes it at exit). It
ignores SIGINT: Ctrl-C is for the workers and the launcher. ``SHMTRAIN_ZYGOTE=0`` starts
every worker as its own ``python -m shmtrain.runtime.launch.worker`` instead.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

from shmtrain.runtime.launch import reaping

_PR_SET_PDEATHSIG, _PR_SET_NAME, _PR_SET_CHILD_SUBREAPER = 1, 15, 36
_MAX_FDS = 8
#: seconds the zygote may take to import torch (a busy machine takes tens)
START_S = 120.0
#: imported by the zygote before it forks anything (what every worker would import)
PRELOAD = ("torch", "torch.distributed", "numpy", "shmtrain.runtime.launch.worker",
           "shmtrain.runtime.run.loop", "shmtrain.strategies",
           # a torch.optim optimizer's first construction imports torch._dynamo (~1.2 s of
           # CPU per worker otherwise); importing it starts no thread
           "torch._dynamo")
#: a worker environment's list of further modules the zygote imports before forking it
#: (comma-separated; ``shmtrain train`` asks for torchvision when the model is one of its:
#: 1.3 s once here, instead of in every worker, and not at all for the other models)
PRELOAD_ENV = "SHMTRAIN_PRELOAD"


def enabled() -> bool:
    return os.environ.get("SHMTRAIN_ZYGOTE", "1") != "0"


# -- the zygote process ----------------------------------------------------------------------
def name_process(name: bytes) -> None:
    """Name this process (``/proc/<pid>/comm``, 15 bytes at most), so it is found by name."""
    _prctl(_PR_SET_NAME, name)


def _prctl(option: int, value: Any) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(option, value, 0, 0, 0)


def _serve(sock: socket.socket) -> None:
    """Fork a worker per request; report forks and exits; return when the launcher has
    closed its end and every worker has ended. What a worker started is ended with it
    (:func:`shmtrain.runtime.launch.reaping.reap`)."""
    live: set[int] = set()
    exits: dict[int, int] = {}  # a worker's pidfd, readable once it ends: its exit is reported at once
    open_ = True
    while open_ or live:
        ready, _, _ = select.select([sock, *exits.values()] if open_ else list(exits.values()), [], [], 0.05)
        if sock in ready:
            try:
                data, fds, _, _ = socket.recv_fds(sock, 1 << 20, _MAX_FDS)
            except OSError:
                data, fds = b"", []
            if not data:
                open_ = False
            else:
                request = json.loads(data)
                _preload(request["env"].get(PRELOAD_ENV, ""))
                pid = _fork(sock, request, fds)
                live.add(pid)
                with contextlib.suppress(OSError, AttributeError):  # without pidfds: the 50 ms poll
                    exits[pid] = os.pidfd_open(pid)
                _send(sock, {"pid": pid})
        reaping.reap(live, lambda pid, code: _send(sock, {"exit": pid, "code": code}))
        for pid in set(exits) - live:
            os.close(exits.pop(pid))
    reaping.kill_children()


def preload_workers(extra: str = "", data: bool = True) -> None:
    """Import, once in this process, what every worker would: :data:`PRELOAD`, the
    comma-separated ``extra`` (:data:`PRELOAD_ENV`'s form) and, with ``data``, the digits
    data set (read once: every forked worker shares its pages). Used by the zygote and by
    ``shmtrain torchrun`` (:mod:`shmtrain.fork_torchrun`) before they fork."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    _preload(extra)
    if data:
        try:
            from shmtrain.runtime.data.tensors import load_digits_data

            load_digits_data()
        except ImportError:  # scikit-learn missing: a worker that needs it says so
            pass


def _preload(names: str) -> None:
    import importlib

    for name in filter(None, (n.strip() for n in names.split(","))):
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # the worker imports it itself and reports what is missing


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    try:
        sock.send(json.dumps(message).encode())
    except OSError:
        pass  # the launcher is gone; its death signal ends us


def _fork(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> int:
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    code = 1
    try:
        sock.close()
        code = _become_worker(request, fds)
    except BaseException:  # noqa: BLE001 - a child must never return into the zygote's loop
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    return 0  # not reached


def _become_worker(request: dict[str, Any], fds: list[int]) -> int:
    """In the forked child: the launcher's environment, folder and output, then the worker."""
    stdout, stderr, *inherited = fds
    env = request["env"]
    names = {f"{{fd{i}}}": str(fd) for i, fd in enumerate(inherited)}
    env = {key: names.get(value, value) for key, value in env.items()}
    os.chdir(request["cwd"])  # first: a relative log path is the launcher's
    os.dup2(stdout, 1)
    if request.get("log"):
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 2)
        os.close(log)
    else:
        os.dup2(stderr, 2)
    os.close(stdout)
    os.close(stderr)
    for fd in inherited:
        os.set_inheritable(fd, True)
    os.environ.clear()
    os.environ.update(env)
    for entry in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _prctl(_PR_SET_NAME, f"shmtrain-w{env.get('RANK', '?')}".encode())
    sys.argv = ["shmtrain.runtime.launch.worker", *request["argv"]]
    from shmtrain.runtime.launch import worker

    return worker.main()


def main() -> int:
    """``python -m shmtrain.runtime.launch.zygote FD``: serve the launcher on socket ``FD``."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # a dead worker's children come here, not to init
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked by the launcher's fork
    sock = socket.socket(fileno=int(sys.argv[1]))
    preload_workers()
    _send(sock, {"ready": os.getpid()})
    _serve(sock)
    # every worker has ended and been reported: leave without tearing down torch's
    # modules (a second or more on a busy machine, spent while the launcher waits)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- the launcher's side -----------------------------------------------------------------------
class Worker:
    """A forked worker, with the part of :class:`subprocess.Popen` the launcher uses."""

    def __init__(self, pid: int, zygote: Zygote) -> None:
        self.pid = pid
        self.returncode: int | None = None
        #: the zygote that forked it (a worker dies with it)
        self.zygote = zygote

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self.zygote.exited(self, timeout):
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:  # not yet reaped: the pid is still this worker's
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The launcher's handle on its zygote process (one per launcher process)."""

    def __init__(self, timeout: float) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        with _sigint_ignored_in_child():
            self.process = subprocess.Popen(
                [sys.executable, "-m", "shmtrain.runtime.launch.zygote", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env,
            )
        theirs.close()
        self.timeout = timeout
        self.lock = threading.Lock()  # one spawn at a time (the reply is the next pid)
        self.changed = threading.Condition()
        self.workers: dict[int, Worker] = {}
        self.codes: dict[int, int] = {}  # exits reported before the pid was claimed
        self.pids: list[int] = []
        self.reader: threading.Thread | None = None  # started by the hand-shake

    def _handshake(self) -> None:
        """Wait for the zygote's imports (it started importing when it was created, so
        this overlaps whatever the launcher did meanwhile), then start the reader."""
        if self.reader is not None:
            return
        self.sock.settimeout(self.timeout)
        try:
            hello = json.loads(self.sock.recv(4096) or b"{}")
        except (OSError, ValueError) as exc:
            self.close()
            raise RuntimeError(f"the worker zygote did not start within {self.timeout:.0f} s ({exc}); "
                               "set SHMTRAIN_ZYGOTE=0 to start workers without it") from None
        if "ready" not in hello:
            self.close()
            raise RuntimeError("the worker zygote failed while importing torch; set SHMTRAIN_ZYGOTE=0 "
                               "to see the error from each worker")
        self.sock.settimeout(None)
        self.reader = threading.Thread(target=self._read, name="shmtrain-zygote", daemon=True)
        self.reader.start()

    def alive(self) -> bool:
        return self.process.poll() is None and (self.reader is None or self.reader.is_alive())

    def spawn(self, env: dict[str, str], argv: list[str], fds: tuple[int, ...], log: str | None) -> Worker:
        """Fork one worker: ``env`` (``{fd<i>}`` values name ``fds[i]`` as the worker sees
        it), ``python -m shmtrain.runtime.launch.worker *argv``, stderr to ``log`` when given."""
        request = {"env": env, "argv": argv, "cwd": os.getcwd(), "log": log}
        with self.lock:
            self._handshake()
            assert self.reader is not None
            with self.changed:
                waiting = len(self.pids)
            socket.send_fds(self.sock, [json.dumps(request).encode()],
                            [sys.stdout.fileno() if _has_fd(sys.stdout) else 1,
                             sys.stderr.fileno() if _has_fd(sys.stderr) else 2, *fds])
            with self.changed:
                if not self.changed.wait_for(lambda: len(self.pids) > waiting or not self.reader.is_alive(), 60):
                    raise RuntimeError("the worker zygote did not fork within 60 s")
                if len(self.pids) <= waiting:
                    raise RuntimeError("the worker zygote died; set SHMTRAIN_ZYGOTE=0 to start workers without it")
                pid = self.pids.pop(waiting)
                worker = Worker(pid, self)
                self.workers[pid] = worker
                if pid in self.codes:
                    worker.returncode = self.codes.pop(pid)
        return worker

    def exited(self, worker: Worker, timeout: float | None) -> bool:
        reader = self.reader
        assert reader is not None
        with self.changed:
            return self.changed.wait_for(lambda: worker.returncode is not None or not reader.is_alive(),
                                         timeout) and worker.returncode is not None

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(4096)
            except OSError:
                data = b""
            with self.changed:
                if not data:
                    for worker in self.workers.values():  # the zygote is gone, and with it
                        if worker.returncode is None:     # (death signal) every worker
                            worker.returncode = -signal.SIGKILL
                    self.changed.notify_all()
                    return
                message = json.loads(data)
                if "pid" in message:
                    self.pids.append(message["pid"])
                elif "exit" in message:
                    worker = self.workers.pop(message["exit"], None)
                    if worker is None:
                        self.codes[message["exit"]] = message["code"]
                    else:
                        worker.returncode = message["code"]
                self.changed.notify_all()

    def close(self) -> None:
        """Close our end: the zygote exits once its workers have ended (at once when it
        has forked none: it may still be importing)."""
        if self.reader is None and self.process.poll() is None:
            self.process.kill()
        try:
            try:  # wakes our reader's recv and tells the zygote (a bare close would wait for the reader)
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()
        finally:
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextlib.contextmanager
def _sigint_ignored_in_child() -> Iterator[None]:
    """Start a child with SIGINT ignored from its first instruction (a Ctrl-C while it
    imports must not print its traceback): ignored dispositions survive exec, and Python
    leaves an ignored SIGINT alone. Blocked meanwhile here, so a Ctrl-C to this process
    is delivered after, not lost; the child unblocks it (:func:`main`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _has_fd(stream: Any) -> bool:
    try:
        stream.fileno()
        return True
    except (AttributeError, OSError, ValueError):
        return False


_ZYGOTE: Zygote | None = None
_ZYGOTE_LOCK = threading.Lock()


def prestart() -> None:
    """Start this process's zygote now without waiting for it (``shmtrain train`` does
    this first, so the zygote imports torch while the launcher checks its input); not in
    a worker that torchrun started, which forks none."""
    from shmtrain.fabric.job.context import under_torchrun

    if enabled() and not under_torchrun():
        get(START_S)


def get(timeout: float = 120.0) -> Zygote:
    """This process's zygote, started on first use (and again if it died); its imports
    may still be running (the first spawn waits for them)."""
    global _ZYGOTE
    with _ZYGOTE_LOCK:
        if _ZYGOTE is None or not _ZYGOTE.alive():
            if _ZYGOTE is not None:
                _ZYGOTE.close()
            _ZYGOTE = Zygote(timeout)
            atexit.register(shutdown)
        return _ZYGOTE


def pid() -> int | None:
    """The zygote's pid, when this process has one running (the tests' leak check spares it)."""
    return _ZYGOTE.process.pid if _ZYGOTE is not None and _ZYGOTE.process.poll() is None else None


def shutdown() -> None:
    """End this process's zygote (after its workers): at exit, or when asked. A Ctrl-C
    meanwhile (the third of a stop, typed while the launcher exits) is ignored, or kills
    the zygote at once: no traceback from an exit handler."""
    global _ZYGOTE
    with _ZYGOTE_LOCK:
        zygote, _ZYGOTE = _ZYGOTE, None
        if zygote is None:
            return
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
        try:
            zygote.close()
        except KeyboardInterrupt:  # came before SIGINT was ignored
            zygote.process.kill()
        finally:
            if main_thread:
                signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)


if __name__ == "__main__":
    sys.exit(main())
