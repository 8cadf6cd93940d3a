"""A call to the memory server that never returns ends the worker, naming the server.

A TCPStore client waits for its answer without a deadline once the request is sent: a
memory server that is stopped (``kill -STOP``, a host that froze) but keeps its socket
open leaves a worker's ``store.get`` waiting forever, and with it the job, whatever
``--timeout`` says. Python cannot interrupt that wait from another thread, so the calls
are timed from one: :class:`CallWatch` records the call in progress (its words and when
it began, two attribute writes per call) and a daemon thread looks every quarter of the
timeout; a call older than the timeout makes the worker fail as if the call had raised
:class:`~shmtrain.fabric.shm.control.PeerTimeout` naming the server (:func:`set_fatal`:
the worker's own failure path, which reports the error to the launcher and exits).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from shmtrain.fabric.shm.control import PeerTimeout

#: a call is stuck once it has waited this many timeouts
GRACE = 1.5


def _exit(exc: BaseException) -> None:
    print(f"shmtrain: {exc}", file=sys.stderr, flush=True)
    os._exit(1)


#: what a stuck call does to this process (the worker sets its failure path)
_fatal: Callable[[BaseException], None] = _exit


def set_fatal(handler: Callable[[BaseException], None]) -> None:
    """How this process fails when a watched call is stuck (it must not return)."""
    global _fatal
    _fatal = handler


class CallWatch:
    """Calls to the memory server at ``address``, each failing the process once it has
    waited ``timeout`` seconds (module docstring)."""

    def __init__(self, address: str, timeout: float) -> None:
        self.address, self.timeout = address, timeout
        self.current: tuple[str, float] | None = None
        self._closed = threading.Event()
        thread = threading.Thread(target=_watch, args=(weakref.ref(self), self._closed, timeout),
                                  name="shmtrain-smb-watch", daemon=True)
        thread.start()

    @contextmanager
    def call(self, what: str) -> Iterator[None]:
        outer = self.current
        if outer is None:  # a call inside a watched one is timed with it
            self.current = (what, time.monotonic())
        try:
            yield
        finally:
            if outer is None:
                self.current = None

    def stuck(self) -> PeerTimeout | None:
        """The error of the call in progress, once it has waited the timeout and half as
        long again (a call with a deadline of its own, such as the connection's, says first
        what it waited for)."""
        current = self.current
        if current is None or time.monotonic() - current[1] < self.timeout * GRACE:
            return None
        return PeerTimeout(f"the memory server at {self.address} did not answer within "
                           f"{self.timeout * GRACE:.0f} s while {current[0]} (it is stopped or unreachable, but "
                           "its connection is open)", server=self.address)

    def close(self) -> None:
        self._closed.set()


def _watch(ref: weakref.ref, closed: threading.Event, timeout: float) -> None:
    while not closed.wait(max(0.05, timeout / 4)):
        watch = ref()
        if watch is None:
            return
        error = watch.stuck()
        del watch
        if error is not None:
            _fatal(error)
            return
