"""Per-slot critical sections with a counter, shared by the processes of one host.

The TRL paper (Algorithm 7) guards each layer's global gradient with "a blocking queue
that always contains one integer": a thread pops the integer (enters), accumulates,
increments it and pushes it back (leaves); the integer counts the accumulations and
``isUpdated(u)`` compares it with the number of devices. Across processes the queue is
a process-shared POSIX semaphore (``sem_init(pshared=1)``, a futex underneath) in a
shared segment, and the integer a 32-bit word beside it that only the holder writes.
Waiters sleep (the semaphore and the counter word are futexes), in slices, so they can
check the host's abort word and name a dead peer instead of hanging.

Slot layout, one 64-byte line each: ``sem_t`` (32 bytes), counter (int32), holder
(int32, local rank + 1 while held, for error messages).
"""

from __future__ import annotations

import ctypes
import errno
import time
from collections.abc import Callable

import numpy as np

from shmtrain.fabric.shm.control import LINE, PeerTimeout
from shmtrain.fabric.shm.futex import futex_wait, futex_wake
from shmtrain.fabric.shm.segment import SharedSegment

_SEM_BYTES = 32  # sizeof(sem_t) on 64-bit glibc
_COUNTER = 32
_HOLDER = 36
_SLICE_S = 0.05
_CLOCK_MONOTONIC = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
_libc.sem_post.argtypes = [ctypes.c_void_p]
_libc.sem_destroy.argtypes = [ctypes.c_void_p]
_HAS_CLOCKWAIT = hasattr(_libc, "sem_clockwait")
if _HAS_CLOCKWAIT:
    _libc.sem_clockwait.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_Timespec)]
_libc.sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Timespec)]


def _abs_timespec(seconds_from_now: float) -> _Timespec:
    base = time.monotonic() if _HAS_CLOCKWAIT else time.time()
    when = base + max(seconds_from_now, 0.0)
    return _Timespec(int(when), int((when - int(when)) * 1e9))


class CriticalCounters:
    """``count`` critical sections with counters at byte ``offset`` of ``segment``.

    Args:
        segment: a shared segment mapped by every local rank.
        offset: byte offset of the first slot (a multiple of 64).
        count: number of slots.
        rank: this process's local rank (recorded while it holds a slot).
    """

    @staticmethod
    def nbytes(count: int) -> int:
        return LINE * count

    @staticmethod
    def initializer(offset: int, count: int) -> Callable[[SharedSegment], None]:
        """An ``init`` for :meth:`HostGroup.allocate`: set every semaphore to 1 (free)."""

        def init(segment: SharedSegment) -> None:
            for slot in range(count):
                if _libc.sem_init(segment.address(offset + slot * LINE), 1, 1) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"sem_init: {errno.errorcode.get(err, err)}")

        return init

    def __init__(self, segment: SharedSegment, offset: int, count: int, rank: int) -> None:
        if offset % LINE:
            raise ValueError(f"critical slots must start on a {LINE}-byte line, got offset {offset}")
        self.segment = segment
        self.count = count
        self.rank = rank
        self._addr = [segment.address(offset + slot * LINE) for slot in range(count)]
        words = np.frombuffer(segment.buffer, dtype=np.int32, count=count * LINE // 4, offset=offset)
        words = words.reshape(count, LINE // 4)
        self.counters = words[:, _COUNTER // 4]  # live view: read freely, write only while holding
        self._holders = words[:, _HOLDER // 4]

    def acquire(self, slot: int, *, deadline: float, check: Callable[[], None], what: str) -> None:
        """Enter slot ``slot`` (pop the integer); sleep while another process holds it.

        ``check`` is called between sleeps and raises if a peer failed.
        """
        addr = ctypes.c_void_p(self._addr[slot])
        while True:
            spec = _abs_timespec(min(_SLICE_S, deadline - time.monotonic()))
            if _HAS_CLOCKWAIT:
                rc = _libc.sem_clockwait(addr, _CLOCK_MONOTONIC, ctypes.byref(spec))
            else:
                rc = _libc.sem_timedwait(addr, ctypes.byref(spec))
            if rc == 0:
                self._holders[slot] = self.rank + 1
                return
            err = ctypes.get_errno()
            if err not in (errno.ETIMEDOUT, errno.EINTR, errno.EAGAIN):
                raise OSError(err, f"sem_wait on {what}: {errno.errorcode.get(err, err)}")
            check()
            if time.monotonic() >= deadline:
                holder = int(self._holders[slot]) - 1
                raise PeerTimeout(
                    f"local rank {holder} held {what} past the timeout" if holder >= 0
                    else f"{what} stayed locked past the timeout"
                )

    def release(self, slot: int, count: int) -> None:
        """Store ``count`` as the slot's counter, wake counter waiters, leave (push it back)."""
        self.counters[slot] = count
        self._holders[slot] = 0
        futex_wake(self._addr[slot] + _COUNTER)
        _libc.sem_post(ctypes.c_void_p(self._addr[slot]))

    def wait_count(self, slot: int, target: int, *, deadline: float, check: Callable[[], None],
                   what: str, name_peer: Callable[[], str]) -> None:
        """Sleep until slot ``slot``'s counter reaches ``target`` (futex on the counter)."""
        while True:
            value = int(self.counters[slot])
            if value >= target:
                return
            check()
            now = time.monotonic()
            if now >= deadline:
                raise PeerTimeout(f"{name_peer()} did not deliver {what} within the timeout")
            futex_wait(self._addr[slot] + _COUNTER, value, min(_SLICE_S, deadline - now))
