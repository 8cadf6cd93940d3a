"""The per-host control block: sequence words, peer liveness, abort, progress.

One small shared segment per host. Each local rank owns one 32-bit sequence word per
*channel* (a protocol step such as "gradients arrived"), each on its own cache line;
only its owner writes it (single-writer slots with sequence numbers, no locks), and
waiters sleep on it with a futex. The block also holds every local rank's pid, an
abort word (the first failing rank, set by that rank or by the launcher), a stop word
(a stop was requested: the signal number, set by a worker's signal handler or relayed by
the launcher; the training loop reads it once per iteration, see
:mod:`shmtrain.runtime.stop`), and a per-rank progress record (iterations done, state)
used for termination alignment.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

import numpy as np

from shmtrain.fabric.futex import futex_wait, futex_wake
from shmtrain.fabric.segment import SharedSegment

LINE = 64
MAX_CHANNELS = 48
_SLICE_S = 0.05  # how often a sleeping waiter re-checks abort and peer liveness
DIED = 255  # abort code a peer records for a rank it found dead (its exit code is unknown)

# header line 0: [magic, local_world, abort_rank+1, abort_code, stop_signal]
_MAGIC = 0x53484D54


class PeerFailure(RuntimeError):
    """A peer died or reported an error; raised instead of hanging. ``peer`` is its local
    rank when known (the launcher then reports that peer as the root cause)."""

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class PeerTimeout(TimeoutError):
    """A peer did not answer within the timeout; ``peer`` is its local rank when known
    (the launcher then blames that peer, not the worker that gave up)."""

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not yet registered
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


class ControlBlock:
    """Sequence words and liveness for the ``local_world`` workers of one host."""

    @staticmethod
    def nbytes(local_world: int) -> int:
        return LINE * (1 + 3 * local_world + MAX_CHANNELS * local_world)

    def __init__(self, segment: SharedSegment, local_world: int, *, init: bool) -> None:
        self.segment = segment
        self.local_world = local_world
        n = self.nbytes(local_world)
        self._i32 = np.frombuffer(segment.buffer, dtype=np.int32, count=n // 4)
        self._i64 = np.frombuffer(segment.buffer, dtype=np.int64, count=n // 8)
        self._base = segment.address(0)
        if init:
            self._i32[:] = 0
            self._i32[0] = _MAGIC
            self._i32[1] = local_world
        elif int(self._i32[0]) != _MAGIC or int(self._i32[1]) != local_world:
            raise PeerFailure(
                f"control block {segment.name!r} is not initialised for {local_world} workers"
            )

    # -- layout ---------------------------------------------------------------
    def _pid_off(self, rank: int) -> int:
        return LINE * (1 + rank)

    def _progress_off(self, rank: int) -> int:
        return LINE * (1 + self.local_world + rank)

    def _state_off(self, rank: int) -> int:
        return LINE * (1 + 2 * self.local_world + rank)

    def _word_off(self, channel: int, rank: int) -> int:
        if not 0 <= channel < MAX_CHANNELS:
            raise ValueError(f"channel {channel} outside 0..{MAX_CHANNELS - 1}")
        return LINE * (1 + 3 * self.local_world + channel * self.local_world + rank)

    # -- identity and progress --------------------------------------------------
    def set_pid(self, rank: int, pid: int) -> None:
        self._i64[self._pid_off(rank) // 8] = pid

    def pid(self, rank: int) -> int:
        return int(self._i64[self._pid_off(rank) // 8])

    def set_progress(self, rank: int, iterations: int) -> None:
        self._i64[self._progress_off(rank) // 8] = iterations

    def progress(self, rank: int) -> int:
        return int(self._i64[self._progress_off(rank) // 8])

    def set_state(self, rank: int, state: int) -> None:
        self._i32[self._state_off(rank) // 4] = state

    def state(self, rank: int) -> int:
        return int(self._i32[self._state_off(rank) // 4])

    # -- abort ------------------------------------------------------------------
    def abort(self, rank: int, code: int = 1) -> None:
        """Record that local ``rank`` failed (first writer wins) and wake every waiter."""
        if int(self._i32[2]) == 0:
            self._i32[3] = code
            self._i32[2] = rank + 1
        for channel in range(MAX_CHANNELS):
            for r in range(self.local_world):
                futex_wake(self._base + self._word_off(channel, r))

    def aborted(self) -> tuple[int, int] | None:
        """``(rank, code)`` of the first failure, or None."""
        who = int(self._i32[2])
        return (who - 1, int(self._i32[3])) if who else None

    # -- stop request -------------------------------------------------------------
    def request_stop(self, signum: int) -> None:
        """Ask every worker of the host to stop after a checkpoint (first request wins)."""
        if int(self._i32[4]) == 0:
            self._i32[4] = signum

    def stop_requested(self) -> int:
        """The signal number of a pending stop request, or 0 (one load: cheap per iteration)."""
        return int(self._i32[4])

    # -- sequence words ---------------------------------------------------------
    def get(self, channel: int, rank: int) -> int:
        return int(self._i32[self._word_off(channel, rank) // 4])

    def post(self, channel: int, rank: int, value: int) -> None:
        """Publish ``value`` in ``rank``'s word of ``channel`` and wake its waiters."""
        off = self._word_off(channel, rank)
        self._i32[off // 4] = value
        futex_wake(self._base + off)

    def wait(
        self,
        channel: int,
        ranks: Iterable[int],
        target: int,
        *,
        timeout: float,
        what: str,
    ) -> None:
        """Sleep until every rank in ``ranks`` has posted at least ``target`` on ``channel``.

        Raises:
            PeerFailure: a peer died or aborted (names it).
            PeerTimeout: a peer did not post within ``timeout`` seconds (names it).
        """
        deadline = time.monotonic() + timeout
        for rank in ranks:
            off = self._word_off(channel, rank)
            idx = off // 4
            while True:
                value = int(self._i32[idx])
                if value >= target:
                    break
                self._check(rank, what)
                now = time.monotonic()
                if now >= deadline:
                    raise PeerTimeout(
                        f"local rank {rank} (pid {self.pid(rank)}) did not reach {what} "
                        f"#{target} within {timeout:.0f} s", peer=rank,
                    )
                futex_wait(self._base + off, value, min(_SLICE_S, deadline - now))

    def _check(self, rank: int, what: str) -> None:
        failed = self.aborted()
        if failed is not None:
            who, code = failed
            how = "died" if code == DIED else (f"was killed by signal {code - 128}" if code > 128 else f"failed (exit status {code})")
            raise PeerFailure(f"local rank {who} (pid {self.pid(who)}) {how} while this worker waited for {what}",
                              peer=who)
        if not _alive(self.pid(rank)):
            # Record the dead peer as the first failure before this worker's own error
            # does (first writer wins), so every other waiter names the root cause.
            self.abort(rank, DIED)
            raise PeerFailure(
                f"local rank {rank} (pid {self.pid(rank)}) died while this worker waited for {what}", peer=rank
            )
