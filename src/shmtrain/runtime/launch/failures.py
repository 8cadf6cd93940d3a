"""What a failed job's one line names: the worker whose failure is the root cause, how it
exited, and where its log is (``runtime/launch/launcher.py``'s supervisor raises it)."""

from __future__ import annotations

import re
import shutil
import signal
import time
from typing import Any

from shmtrain.runtime.outputs.worker_logs import WorkerLogs

#: how long the supervisor looks for a worker killed by a signal once another failed with an
#: error: a peer's error on a closed connection follows the kill within milliseconds
KILLED_FIRST_S = 0.5


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
        #: the worker's own one-line cause (its exception), when it reported one
        self.cause: str | None = None
        #: True when the zygote that forked the workers died (and they with it)
        self.zygote = False
        #: True when the worker's training diverged (a non-finite loss or state): a restart
        #: from the same checkpoint would meet it again, so none is made
        self.diverged = False


#: the exit status of a job one of whose ranks ended with status 0 while the others needed it
EARLY_EXIT = 1


def exit_status(code: int) -> int:
    """The launcher's exit status for a worker that ended with ``code`` (as
    :attr:`subprocess.Popen.returncode`): its own status; 128 + N when signal N killed it;
    :data:`EARLY_EXIT` (1) for a status 0 that still failed the job (a rank that left early)."""
    if code < 0:
        return 128 - code
    return code or EARLY_EXIT


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def shm_note(code: int) -> str:
    """For a worker killed by SIGBUS: the likely cause (a full /dev/shm) and the fix."""
    if code not in (-signal.SIGBUS, 128 + signal.SIGBUS):
        return ""
    try:
        usage = shutil.disk_usage("/dev/shm")
        now = f"it has {usage.free / 1e6:.1f} MB free of {usage.total / 1e6:.1f} MB now"
    except OSError:
        now = "it cannot be read now"
    return (f" (a SIGBUS in a worker means a shared-memory page could not be given, most often because "
            f"/dev/shm is full: {now}; free space there (df -h /dev/shm), use fewer workers or a "
            "smaller model, and leave out --force so the memory check can refuse such a run)")


#: what gloo and the store say when the process at the other end is gone
CONNECTION_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe",
                   "connection refused", "socket closed")


def connection_lost(cause: str) -> bool:
    """Whether a worker's error says its peer's end of a connection went away."""
    return any(words in cause.lower() for words in CONNECTION_LOST)


#: seconds a rank that lost a connection waits for the other ranks to report their failure
ROLL_CALL_S = 3.0


def roll_call(store: Any, rank: int, world: int, cause: str, grace: float = ROLL_CALL_S) -> list[int]:
    """Post this rank's failure (``failed/<rank>``) in the job's store and wait up to
    ``grace`` seconds for every other rank to post its own (every rank that fails posts,
    ``runtime/run/training.py``); the ranks that have not are returned: lost (killed, or their host
    went down), since a rank that fails for a cause of its own says so."""
    store.set(f"failed/{rank}", cause)
    deadline = time.monotonic() + grace
    while True:
        missing = [r for r in range(world) if r != rank and not store.check([f"failed/{r}"])]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.1)


def short_cause(text: str) -> str:
    """gloo's error without its source location and advice: ``Connection closed by peer
    [127.0.0.1]:35229``."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", text.strip().splitlines()[0] if text.strip() else "")
    return text.split(". ", 1)[0]


def lost_peers_message(rank: int, local_world: int, lost: list[int], cause: str) -> str:
    """``worker rank 2 (host 1, local rank 0) was lost ...``: the peers a connection loss
    came from, by host and rank, and the survivor's own account in brackets."""
    names = ", ".join(f"worker rank {r} (host {r // local_world}, local rank {r % local_world})" for r in lost)
    one = len(lost) == 1
    return (f"{names} {'was' if one else 'were'} lost: {'it' if one else 'they'} stopped without reporting "
            f"an error (killed, or the host went down; see that host's output); worker rank {rank} (host "
            f"{rank // local_world}) only lost its connection to {'it' if one else 'them'} ({cause})")


def first_cause(children: list[Any], bad: list[tuple[int, int]], lost: dict[int, int]) -> tuple[int, int]:
    """``(rank, exit code)`` of the failure to report among ``bad``: a worker killed by a
    signal before one that failed with an error (the error is most often its peer noticing
    the kill: "Connection reset by peer"), looked for up to :data:`KILLED_FIRST_S`."""
    deadline = time.monotonic() + (KILLED_FIRST_S if bad[0][1] > 0 else 0.0)
    while True:
        killed = [(r, c) for r, c in bad if c < 0]
        if killed:
            return killed[0]
        if time.monotonic() >= deadline:
            return bad[0]
        time.sleep(0.05)
        codes = [c.poll() for c in children]
        bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0) and r not in lost] or bad


def root_cause(children: list[Any], rank: int, code: int, record: dict[str, Any],
                stuck: list[int], lost: dict[int, int], logs: WorkerLogs, job: Any) -> WorkerFailed:
    """The one-line failure: the first worker to fail, unless it only failed because of a
    peer: one it gave up waiting for (that peer stalled; the launcher ended it), or one it
    found dead or failed (that peer's own failure is the cause)."""
    peer = record.get("peer")
    if record.get("timeout") and peer is None and stuck and not record.get("server"):
        peer = stuck[0]  # (a memory server that did not answer is named by the worker's own line)
    if peer is None and connection_lost(record.get("cause") or ""):
        peer = next((r for r, c in enumerate(children) if r != rank and c.returncode is not None
                     and r not in stuck), None)  # the one that had already ended: it closed the connection
    if peer is None or peer == rank or not 0 <= peer < len(children):
        failure = failure_of(children, rank, code, record, logs)
    elif record.get("timeout"):
        how = describe_exit(children[peer].returncode) if peer in stuck else "it did not answer"
        message = (f"worker rank {peer} (pid {children[peer].pid}) stalled: worker rank {rank} gave up "
                   f"waiting for it ({record.get('cause')}); the launcher ended it ({how})")
        failure = WorkerFailed(message + logs.where(peer), peer, children[peer].returncode or code)
        failure.cause = record.get("cause")
    elif children[peer].returncode == 0:  # it left the job early, without an error
        message = (f"worker rank {peer} (pid {children[peer].pid}) left the job early: it ended with exit "
                   f"status 0 (sys.exit(0), or its script returned) while worker rank {rank} still needed "
                   f"it ({record.get('cause') or describe_exit(code)}); every rank must run the same "
                   "steps (to end early, make all of them stop at the same step)")
        failure = WorkerFailed(message + logs.where(peer), peer, 0)  # exit_status: EARLY_EXIT
        failure.cause = record.get("cause")
    else:
        peer_code = children[peer].returncode
        peer_code = code if peer_code is None else peer_code
        failure = failure_of(children, peer, peer_code, error_record(job, peer, peer_code), logs)
    if lost:
        failure.args = (failure.args[0] + "".join(
            f" (after worker rank {r} died: {describe_exit(c)})" for r, c in lost.items()),)
    return failure


def failure_of(children: list[Any], rank: int, code: int, record: dict[str, Any],
                logs: WorkerLogs) -> WorkerFailed:
    """``worker rank R (pid P) failed: <its own cause, or how it exited>; its log: ...``."""
    pid = children[rank].pid
    cause = record.get("cause")
    if cause:
        failure = WorkerFailed(f"worker rank {rank} (pid {pid}) failed: {cause}" + logs.where(rank), rank, code)
    else:
        failure = WorkerFailed(f"worker rank {rank} (pid {pid}) failed: {describe_exit(code)}"
                               + shm_note(code) + logs.last_line(rank) + logs.where(rank), rank, code)
    failure.cause = cause
    failure.diverged = bool(record.get("diverged"))
    return failure


def error_record(job: Any, rank: int, code: int) -> dict[str, Any]:
    """The worker's own account of its failure (its ``error-<rank>`` file in the job's
    folder, ``runtime/launch/job_dir.py``: ``cause``, ``peer``, ``timeout``); empty when it
    had none to give (killed by a signal, or failed before it joined the job)."""
    if code < 0:
        return {}
    return job.error(rank)
