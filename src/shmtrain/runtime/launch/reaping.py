"""Nothing a worker starts outlives it: its process group and the orphans it leaves are
killed when it ends (``runtime/launch/zygote.py``, ``runtime/launch/launcher.py``).

A ``shmtrain run`` script's worker leads its own session and process group (``os.setsid``,
as torchrun's workers do); the ``Popen`` children and forks it leaves there are killed
with the group when the worker ends, as torchrun kills each worker's group when it
closes. Children that left the group (a daemonized fork, ``start_new_session=True``) or
that never had one of their own (a ``shmtrain train`` worker shares the launcher's
group) are reparented to the zygote, the subreaper of every worker's descendants
(``PR_SET_CHILD_SUBREAPER``), which kills them once no worker is live. So on every exit
path (a normal end, a failure, Ctrl-C) none keeps running, nor keeps the launcher's
stdout open (``shmtrain run ... | tail`` ends with the run).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable


def reap(live: set[int], report: Callable[[int, int], None]) -> None:
    """Collect every ended child of this process (the zygote). A worker (a pid in
    ``live``) is reported as ``report(pid, code)`` (``code`` as
    :attr:`subprocess.Popen.returncode`) after its process group is killed; an adopted
    orphan is reaped silently; once no worker is left, every child still running is
    killed (:func:`kill_children`)."""
    ended_worker = False
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        if pid not in live:
            continue  # an orphan a worker left, adopted and now ended
        live.discard(pid)
        ended_worker = True
        kill_group(pid)
        report(pid, -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
    if ended_worker and not live:
        kill_children()


def kill_group(pgid: int) -> None:
    """SIGKILL process group ``pgid``: the group an ended worker led (none, when it led none)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_children() -> None:
    """SIGKILL every child of this process (in the zygote with no worker live: orphans)."""
    me = str(os.getpid())
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:  # its parent
            try:
                os.kill(int(entry), signal.SIGKILL)
            except ProcessLookupError:
                pass
