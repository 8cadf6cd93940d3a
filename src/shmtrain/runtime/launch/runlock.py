"""One run per folder: an advisory lock on ``RUN_DIR/.shmtrain.lock``.

``shmtrain train`` takes the lock (``fcntl.flock``, exclusive, not blocking) before it
writes anything into the run folder, ``--resume`` included, and holds it for the run's
life. The kernel releases it when the holder's descriptor closes, so a run that
crashes or is killed (SIGKILL) never blocks the resume that follows. The holder writes
its pid, host and start time into the file, so a second run refused here can name it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from pathlib import Path

#: the lock file's name inside the run folder
LOCK_NAME = ".shmtrain.lock"


class RunLock:
    """The held lock of one run folder; :meth:`release` (or the process's end) frees it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        """Unlock and close (idempotent)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def holder(path: Path) -> tuple[str | None, str]:
    """Who holds the lock file ``path``, as its holder wrote it: its pid (None when not
    written yet) and ``"pid 123 on host h, since ..."``."""
    try:
        words = path.read_bytes().decode(errors="replace").split()
    except OSError:
        words = []
    if len(words) >= 2:
        since = f", since {' '.join(words[2:])}" if len(words) > 2 else ""
        return words[0], f"pid {words[0]} on host {words[1]}{since}"
    return None, "a process that has not written its pid yet"


def acquire(out: Path, *, resume: bool) -> RunLock:
    """Lock run folder ``out`` (created when missing) for this process.

    Raises:
        ValueError: another live run holds it (names its pid and host and the fix), or
            the folder cannot be created or locked (names it); exit status 2.
    """
    flag = "--resume" if resume else "--out"
    path = out / LOCK_NAME
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ValueError(
            f"{flag} {out}: the run folder cannot be written ({exc.strerror or exc}: {exc.filename or out}); "
            "give a folder you can write, e.g. --out runs/my-run"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise ValueError(f"{flag} {out}: cannot lock {path} ({exc.strerror or exc}); "
                             "give a run folder on a local file system") from None
        pid, who = holder(path)
        what = f"the run in {out} is still going" if resume else f"another shmtrain run is using {out}"
        stop = f" (or stop it and save: kill -INT {pid})" if pid else ""
        fix = (f"wait for it to end{stop}, then continue it with: shmtrain train --resume {out}" if resume
               else f"wait for it to end{stop}, or give this run another --out")
        raise ValueError(f"{flag} {out}: {what} ({who}; it holds {path}); two runs in one "
                         f"folder would mix their metrics and checkpoints; {fix}") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()} {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n"
                  .encode(), 0)
    except OSError:
        pass  # a full disk: the lock holds all the same; a refused run names no pid
    return RunLock(path, fd)
