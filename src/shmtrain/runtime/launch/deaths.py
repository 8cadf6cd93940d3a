"""The supervisor's wait between polls of its workers, woken by a worker's death: a launch
that replaces a dead worker in place acts on the death at once, not at the next poll."""

from __future__ import annotations

import contextlib
import os
import select
from collections.abc import Sequence
from typing import Any


class DeathWait:
    """Waits of up to a poll's length that end when a worker ends: the zygote's report of
    an exit wakes them (its workers), or the worker's pidfd, readable once it ends (workers
    started without the zygote)."""

    def __init__(self) -> None:
        self._pidfds: dict[int, int] = {}  # worker pid -> its pidfd

    def nap(self, children: Sequence[Any], seconds: float) -> None:
        zygotes = {getattr(c, "zygote", None) for c in children}
        if len(zygotes) == 1 and None not in zygotes:
            zygote = zygotes.pop()
            ended = [c.poll() is not None for c in children]
            with zygote.changed:
                zygote.changed.wait_for(lambda: [c.poll() is not None for c in children] != ended, seconds)
            return
        pids = {c.pid for c in children if c.poll() is None}
        for pid in set(self._pidfds) - pids:
            os.close(self._pidfds.pop(pid))
        for pid in pids - set(self._pidfds):
            with contextlib.suppress(OSError, AttributeError):  # gone already, or no pidfds: the poll sees it
                self._pidfds[pid] = os.pidfd_open(pid)
        select.select(list(self._pidfds.values()), [], [], seconds)  # none: a plain sleep

    def close(self) -> None:
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()
