"""The ``Work`` of the ``shm`` backend and its error type.

Why a Work of its own. ``torch.futures.Future.set_exception`` does not fail the future in
C++: it completes it *successfully* with the exception object as its value, and only the
Python wrapper's ``wait()`` raises it. ``_create_work_from_future`` of such a future then
reports success (``wait()`` returns, ``is_success()`` is true), and DDP's reducer, in C++,
took the exception object for the bucket's tensors (the SIGSEGV of ``test_ddp_create_graph``):
an error became a silently unreduced tensor or a crash.

:class:`ShmWork` subclasses c10d's ``Work`` in Python: ``wait()`` raises the error itself
(:class:`ShmBackendError`, type kept), ``is_success()`` is false, and its future is the
source future chained through a callback that re-raises, which fails the chained future in
C++ (its error reads ``... ShmBackendError: <message>``), so DDP's reducer raises.

torch wraps a Python backend's ``Work`` in its ``PyWorkHolder`` before handing it to the
caller of ``dist.all_reduce(..., async_op=True)``: the holder forwards ``wait()`` and
``get_future()`` only, so on that object ``is_completed()`` stays false and
``is_success()`` true (for gloo's works handed through a Python backend too). ``wait()``
and the future are what DDP and ``dist.*`` use; the rest is right on the backend's own
``ShmWork`` (``backend.allreduce(...)``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Work


class ShmBackendError(dist.DistBackendError):
    """A collective of the ``shm`` backend failed: a peer died or timed out, the ranks
    passed different tensors, or the reduction raised. The message names this rank, the
    peer or the mismatch, and what to do."""


class ShmWork(Work):
    """One call's work: its shared-memory part, finished by :meth:`finish` (at once on the
    caller's thread, or later on the group's reduction thread), and the gloo works it
    waits for too (``allreduce_coalesced`` of tensors gloo reduces).

    Args:
        tensors: the call's tensors (the future's value and :meth:`result`).
        gloo: works of the same call that gloo runs.
        pending: whether a shared-memory part is still to come (:meth:`finish`).
        error: the shared-memory part's error, where it is done already (``pending`` False).
    """

    def __init__(self, tensors: Sequence[torch.Tensor], gloo: Sequence[Work] = (), *, pending: bool = True,
                 error: BaseException | None = None) -> None:
        super().__init__()
        self._tensors = tensors if isinstance(tensors, list) else list(tensors)
        self._gloo = list(gloo)
        self._error: BaseException | None = None
        self._source: torch.futures.Future = torch.futures.Future()
        self._future: torch.futures.Future | None = None
        if pending or error is not None:
            self._done = threading.Event()
            # the callback re-raises a set_exception: that fails the chained future in C++
            self._own: torch.futures.Future = self._source.then(_value)
            if not pending:
                self.finish(error)
        else:  # done and a success (a call on the caller's thread): nothing to wait on, no chain to fail
            self._done = _DONE
            self._source.set_result(self._tensors)
            self._own = self._source

    def finish(self, error: BaseException | None = None) -> None:
        """The shared-memory part is done (``error``: it failed)."""
        self._error = error
        self._done.set()
        if error is None:
            self._source.set_result(self._tensors)
        else:
            self._source.set_exception(error)

    # -- c10d's Work interface -----------------------------------------------------------
    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Block until done; raise the error of a failed part (gloo's or ours)."""
        seconds = timeout.total_seconds() if timeout else 0.0
        if not self._done.wait(seconds if seconds > 0 else None):
            raise ShmBackendError(f"shm backend: the collective was not done within {seconds:g} s "
                                  "(Work.wait(timeout)); it goes on")
        if self._error is not None:
            raise self._error
        for work in self._gloo:
            work.wait(timeout) if seconds > 0 else work.wait()
        return True

    def is_completed(self) -> bool:
        return self._done.is_set() and all(work.is_completed() for work in self._gloo)

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self) -> BaseException | None:
        if self._error is not None:
            return self._error
        for work in self._gloo:
            if work.is_completed() and work.exception() is not None:
                return work.exception()
        return None

    def get_future(self) -> torch.futures.Future:
        """A future of the call's tensors; it holds the error of a failed part (DDP's
        reducer waits on it and raises)."""
        if not self._gloo:
            return self._own
        if self._future is None:
            tensors = self._tensors
            parts = [self._own] + [work.get_future() for work in self._gloo]
            self._future = torch.futures.collect_all(parts).then(lambda done: _all_or_raise(done, tensors))
        return self._future

    def result(self) -> list[torch.Tensor]:
        return self._tensors

    def synchronize(self) -> None:
        """CPU work: nothing to synchronise with."""


_DONE = threading.Event()  # the event of every work done when it was made
_DONE.set()


def _value(source: torch.futures.Future) -> list[torch.Tensor]:
    return source.value()


def _all_or_raise(done: torch.futures.Future, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` once every part of ``done`` succeeded; a failed part's error otherwise
    (``value()`` re-raises it: a callback that did not call it would turn it into success)."""
    for part in done.value():
        part.value()
    return tensors
