"""The per-host control block: sequence words, peer liveness, abort, progress.

One small shared segment per host. Each local rank owns one 32-bit sequence word per
*channel* (a protocol step such as "gradients arrived"), each on its own cache line;
only its owner writes it (single-writer slots with sequence numbers, no locks), and
waiters sleep on it with a futex. The block also holds every local rank's pid, an
abort word (the first failing rank, set by that rank or by the launcher), a stop word
(a stop was requested: the signal number, set by a worker's signal handler or relayed by
the launcher; the training loop reads it once per iteration, see
:mod:`shmtrain.runtime.train.stop`), and a per-rank progress record (iterations done, state)
used for termination alignment, and a per-rank "finished" mark (a worker that ended its
training normally: a peer still waiting for it says so instead of "died").

Waking is cheap and waiting is short: a waiter first spins briefly on
the word when every local rank has a core of its own (a peer that is running posts
within microseconds), then sleeps on the futex; each rank announces the word it sleeps
on in its own "sleeper" line, and ``post`` makes the wake-up system call only when
someone sleeps on that word. A wake-up lost to the store/load race of that handshake
costs at most one short sleep slice (1 ms, doubling to 50 ms while the wait lasts).
Sequence words compare modulo 2**32, so a channel that posts once per block of a
pipelined allreduce never wraps into a wrong answer.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable

import numpy as np

from shmtrain.fabric.shm.affinity import allowed_cores
from shmtrain.fabric.shm.futex import futex_wait, futex_wake
from shmtrain.fabric.shm.segment import SharedSegment

LINE = 64
MAX_CHANNELS = 48
_SLICE_S = 0.05  # how often a sleeping waiter re-checks abort and peer liveness (at most)
_FIRST_SLICE_S = 0.001  # the first sleep: bounds the cost of a lost wake-up
_ANY = -1  # a sleeper line's value when threads sleep on several words
YIELDS = 20  # yields of the core before sleeping, when ranks outnumber cores
SPIN_S = 150e-6  # how long a waiter spins before sleeping, when every rank has a core
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
    (the launcher then blames that peer, not the worker that gave up); ``server``: the
    address of the memory server that did not answer (no worker is to blame)."""

    def __init__(self, message: str, peer: int | None = None, server: str | None = None) -> None:
        super().__init__(message)
        self.peer = peer
        self.server = server


def first_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's first line (gloo's messages run on for lines), at most ``limit``
    characters; its type's name when it says nothing."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else type(exc).__name__


def process_state(pid: int) -> bytes | None:
    """The state letter of process ``pid`` in /proc (``b"R"``, ``b"S"``, ``b"T"``, ``b"Z"``...),
    or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (0 or less: not yet registered, taken as alive)."""
    if pid <= 0:
        return True  # not yet registered
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return process_state(pid) not in (b"Z", b"X")


class ControlBlock:
    """Sequence words and liveness for the ``local_world`` workers of one host."""

    @staticmethod
    def nbytes(local_world: int) -> int:
        return LINE * (1 + 4 * local_world + MAX_CHANNELS * local_world)

    def __init__(self, segment: SharedSegment, local_world: int, *, init: bool) -> None:
        self.segment = segment
        self.local_world = local_world
        n = self.nbytes(local_world)
        self._i32 = np.frombuffer(segment.buffer, dtype=np.int32, count=n // 4)
        self._i64 = np.frombuffer(segment.buffer, dtype=np.int64, count=n // 8)
        self._base = segment.address(0)
        cores = len(allowed_cores())
        self._me: int | None = None
        #: the training this process is in (``DataParallel`` counts them; every rank
        #: creates them in the same order), for :meth:`set_finished`
        self.generation = 0
        #: the steps this process's training has completed (set by ``DataParallel``): a peer
        #: that finished after more steps took part in the one waited for, so it is no failure
        self.steps_done: Callable[[], int] | None = None
        self._indices: dict[int, int] = {}
        self._sleep_lock = threading.Lock()
        self._sleeping: dict[int, int] = {}  # word index -> this process's threads asleep on it
        self.spin = cores >= local_world  # spinning only steals a core from a peer otherwise
        self._sleepers = [self._sleeper_off(r) // 4 for r in range(local_world)]
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

    def _sleeper_off(self, rank: int) -> int:
        return LINE * (1 + 3 * self.local_world + MAX_CHANNELS * self.local_world + rank)

    def _word_off(self, channel: int, rank: int) -> int:
        if not 0 <= channel < MAX_CHANNELS:
            raise ValueError(f"channel {channel} outside 0..{MAX_CHANNELS - 1}")
        return LINE * (1 + 3 * self.local_world + channel * self.local_world + rank)

    # -- identity and progress --------------------------------------------------
    def set_pid(self, rank: int, pid: int) -> None:
        """Register local ``rank``'s pid (liveness); registering this process binds it."""
        if pid == os.getpid():
            self.bind(rank)
        self._i64[self._pid_off(rank) // 8] = pid

    def pid(self, rank: int) -> int:
        return int(self._i64[self._pid_off(rank) // 8])

    def alive(self, rank: int) -> bool:
        """False once local rank ``rank``'s process is known gone (True before it registers)."""
        return alive(self.pid(rank))

    def set_finished(self, rank: int, steps: int) -> None:
        """Record that local ``rank`` ended its training normally after ``steps`` steps (a
        peer that then stops answering finished; it did not die). Kept in the rank's pid
        line with this process's :attr:`generation`, so a mark left by an earlier training
        in the same job (a new ``DataParallel`` on the same context) counts for nothing."""
        self._i64[self._pid_off(rank) // 8 + 1] = (self.generation << 32) | (min(steps, 0xFFFFFFFE) + 1)

    def finished(self, rank: int) -> int | None:
        """The steps after which local ``rank`` finished in this :attr:`generation`, or None."""
        value = int(self._i64[self._pid_off(rank) // 8 + 1])
        if not value or value >> 32 != self.generation:
            return None
        return (value & 0xFFFFFFFF) - 1

    def finished_failure(self, rank: int, what: str, me: int | None = None) -> PeerFailure | None:
        """The error for a waiter (local rank ``me``, default this process's) whose peer
        ``rank`` has finished while it still needs it; None when ``rank`` has not finished,
        or the waiter has finished too (both are ending: their last exchanges are done)."""
        steps = self.finished(rank)
        me = self._me if me is None else me
        if steps is None or (me is not None and self.finished(me) is not None):
            return None
        if self.steps_done is not None and self.steps_done() < steps:
            return None  # the step waited for is one the peer took: its part is there or coming
        return PeerFailure(
            f"local rank {rank} (pid {self.pid(rank)}) finished after {steps} steps while this worker "
            f"waited for {what}: every rank of a synchronous job takes the same number of steps; "
            "wrap the training loop in `with model.join():` (shmtrain.DataParallel) so a rank that runs "
            "out of batches shadows the others' steps until every rank is done, or give every rank the "
            "same number of batches")

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
        idx = self._index(channel, rank)
        i32 = self._i32
        i32[idx] = _as_int32(value)
        for sleeper in self._sleepers:
            if i32[sleeper] in (idx + 1, _ANY):  # someone sleeps on this word: wake them all
                futex_wake(self._base + idx * 4)
                return

    def reset_channel(self, channel: int) -> None:
        """Zero every rank's word of ``channel`` (only while no rank uses it)."""
        for rank in range(self.local_world):
            self._i32[self._index(channel, rank)] = 0

    def word_layout(self, channel: int) -> tuple[int, list[int], list[int]]:
        """For code that waits on the words itself (the compiled pipeline): the block's
        address, the word index of each rank's post on ``channel``, and each rank's
        sleeper count's index (all in 32-bit words from that address)."""
        return self._base, [self._index(channel, r) for r in range(self.local_world)], list(self._sleepers)

    def check(self, rank: int, what: str) -> None:
        """Raise :class:`PeerFailure` if the job was aborted or local rank ``rank`` is dead."""
        self._check(rank, what)

    def _index(self, channel: int, rank: int) -> int:
        """The int32 index of ``rank``'s word of ``channel`` (cached: posts and waits are hot)."""
        key = channel * 4096 + rank
        idx = self._indices.get(key)
        if idx is None:
            idx = self._indices[key] = self._word_off(channel, rank) // 4
        return idx

    def wait(
        self,
        channel: int,
        ranks: Iterable[int],
        target: int,
        *,
        timeout: float,
        what: str,
        spin: bool | None = None,
    ) -> None:
        """Sleep until every rank in ``ranks`` has posted at least ``target`` on ``channel``
        (``spin``: whether to spin first; default :attr:`spin`, False for a helper thread
        whose spinning would take the core from its own process's compute).

        Raises:
            PeerFailure: a peer died or aborted (names it).
            PeerTimeout: a peer did not post within ``timeout`` seconds (names it).
        """
        i32 = self._i32
        deadline: float | None = None
        spin = self.spin if spin is None else spin
        for rank in ranks:
            idx = self._index(channel, rank)
            if _reached(int(i32[idx]), target):
                continue
            if spin:
                stop = time.perf_counter() + SPIN_S
                while not _reached(int(i32[idx]), target):
                    if time.perf_counter() > stop:
                        deadline = self._sleep(rank, idx, target, deadline, timeout, what)
                        break
            elif YIELDS and not self.spin:
                for _ in range(YIELDS):
                    os.sched_yield()  # let a runnable peer on this core post first
                    if _reached(int(i32[idx]), target):
                        break
                else:
                    deadline = self._sleep(rank, idx, target, deadline, timeout, what)
            else:
                deadline = self._sleep(rank, idx, target, deadline, timeout, what)

    def _sleep(self, rank: int, idx: int, target: int, deadline: float | None, timeout: float,
               what: str) -> float:
        """Sleep on word ``idx`` (rank ``rank``'s) until it reaches ``target``; returns the
        deadline so one wait over many ranks keeps one ``timeout``."""
        if deadline is None:
            deadline = time.monotonic() + timeout
        i32, me = self._i32, self._me is not None
        slice_s = _FIRST_SLICE_S
        announced = False
        try:
            while True:
                value = int(i32[idx])
                if _reached(value, target):
                    return deadline
                try:
                    self._check(rank, what)
                except PeerFailure:
                    if _reached(int(i32[idx]), target):  # posted just before it ended: no failure
                        return deadline
                    raise
                now = time.monotonic()
                if now >= deadline:
                    raise PeerTimeout(
                        f"local rank {rank} (pid {self.pid(rank)}) did not reach {what} "
                        f"#{target} within {timeout:.0f} s", peer=rank,
                    )
                if me and not announced:
                    self._announce(idx, +1)  # then re-check: the poster wakes only sleepers
                    announced = True
                    value = int(i32[idx])
                    if _reached(value, target):
                        return deadline
                futex_wait(self._base + idx * 4, value, min(slice_s, deadline - now))
                slice_s = min(slice_s * 2, _SLICE_S)
        finally:
            if announced:
                self._announce(idx, -1)

    def _announce(self, idx: int, delta: int) -> None:
        """Count this process's threads sleeping on word ``idx`` and publish, in this rank's
        sleeper line, that word (one word slept on) or ``_ANY`` (several: wake on any post)."""
        with self._sleep_lock:
            count = self._sleeping.get(idx, 0) + delta
            if count:
                self._sleeping[idx] = count
            else:
                self._sleeping.pop(idx, None)
            words = list(self._sleeping)
            self._i32[self._sleepers[self._me]] = 0 if not words else (words[0] + 1 if len(words) == 1 else _ANY)

    def bind(self, rank: int) -> None:
        """This process is local ``rank``: its sleeps are announced in that rank's sleeper
        line (a block not bound to a rank, e.g. the launcher's, always wakes on post)."""
        self._me = rank

    def check_peers(self, me: int, what: str) -> None:
        """Raise :class:`PeerFailure` if a worker of this host has failed (the first
        recorded failure) or died (recorded here first, so every other waiter names the
        root cause); ``me`` is not checked. For loops that wait on something other than a
        sequence word (e.g. the critical counters of ``cpu_acc``)."""
        failed = self.aborted()
        if failed is not None:
            who, code = failed
            raise PeerFailure(f"local rank {who} (pid {self.pid(who)}) failed (code {code}) during {what}",
                              peer=who)
        for peer in range(self.local_world):
            finished = self.finished_failure(peer, what, me) if peer != me else None
            if finished is not None:
                raise finished
            if peer != me and not alive(self.pid(peer)):
                self.abort(peer, DIED)
                raise PeerFailure(f"local rank {peer} (pid {self.pid(peer)}) died during {what}", peer=peer)

    def _check(self, rank: int, what: str) -> None:
        failed = self.aborted()
        if failed is not None:
            who, code = failed
            ended = f"was killed by signal {code - 128}" if code > 128 else f"failed (exit status {code})"
            how = "died" if code == DIED else ended
            raise PeerFailure(
                f"local rank {who} (pid {self.pid(who)}) {how} while this worker waited for {what}", peer=who
            )
        finished = self.finished_failure(rank, what)
        if finished is not None:
            raise finished
        if not alive(self.pid(rank)):
            # Record the dead peer as the first failure before this worker's own error
            # does (first writer wins), so every other waiter names the root cause.
            self.abort(rank, DIED)
            raise PeerFailure(
                f"local rank {rank} (pid {self.pid(rank)}) died while this worker waited for {what}", peer=rank
            )


def _as_int32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= (1 << 31) else value


def _reached(value: int, target: int) -> bool:
    """``value >= target`` for sequence numbers modulo 2**32 (less than 2**31 apart)."""
    return ((value - target) & 0xFFFFFFFF) < 0x80000000
