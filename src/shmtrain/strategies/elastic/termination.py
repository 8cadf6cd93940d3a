"""Aligning the termination of asynchronous workers (TERM, ShmCaffe Section III-E).

Every worker publishes its iterations done and its state (setting up, training, done)
on a :class:`~shmtrain.fabric.smb.ProgressBoard` after each iteration (the buffer
service's ``board``: the host's control block for the local service);
:class:`Termination` reads those entries and decides whether this worker ends now, by
one of the paper's three criteria:

``master``
    all workers finish when the master worker (rank 0) finishes; the master stops at
    its own target, the others run on (before or past their target) until it has.
``first``
    all workers finish when the first worker to reach its target finishes.
``average``
    all workers finish when the mean of every worker's iteration count reaches the
    target (the total work equals ``workers x target``); a worker past its own target
    counts the iteration each training peer below its target is in as done, so workers
    of equal speed run exactly the target (a stale read can still add an iteration, and
    the total never falls short).

A worker known to be dead never counts as finished (it did not finish), so the others
train on; under ``average`` its frozen count stays in the mean and the survivors make
up for it. Deciding never blocks: no worker waits for a peer that has stopped.

A host that is behind (``average`` with workers on several hosts, ``hosts`` given): the
total alone would let a fast host end the job while a host across a slow link has done
almost nothing, so its data barely counts (measured: 15 iterations of 400 on the far
host, docs/choosing_a_method.md). The rule: the job does not end while a host with a
live training worker has done less than :data:`MIN_HOST_SHARE` of its share, the mean
iterations of those of its workers still training (this one included) below
``MIN_HOST_SHARE x target``; the others train on meanwhile (their iterations count in
the total as before). A host whose workers all died or finished is not waited for, so a
lost host never holds the job; on one host nothing changes.

Pacing the hosts (``lead``, ``--host-lead F``; off on one host, 0.05 by default across
hosts for seasgd and hsgd, ``runtime/defaults.py``): a worker more than
``F x target`` iterations ahead of a host's mean (that host's live training workers)
sleeps in :meth:`Termination.decide` until it is not, so the hosts' exchanges with the
global weights keep the same pace (bounded staleness between hosts; asynchronous within
the bound). The worker with the fewest iterations never waits (it leads no host's mean),
so pacing cannot deadlock; a host that dies or finishes is no longer waited for, and a
wait that lasts ``timeout`` seconds gives up (the worker trains on).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Literal, get_args

from shmtrain.fabric.smb import STATE_DONE, STATE_TRAINING, ProgressBoard

#: ShmCaffe Section III-E's termination policies (``--terminate``)
Policy = Literal["master", "first", "average"]
POLICIES: tuple[str, ...] = get_args(Policy)
MASTER = 0
#: the share of its target a host's training workers must have done on average before
#: ``average`` may end a job that spans hosts (see the module's docstring)
MIN_HOST_SHARE = 0.5


def check_terminate(value: str) -> None:
    """Reject an unknown policy with the option, the value and the choices."""
    if value not in POLICIES:
        raise ValueError(
            f"--terminate {value!r} is not a termination policy; choose one of "
            f"{', '.join(POLICIES)} (ShmCaffe Section III-E: stop with the master, with the "
            "first finisher, or when the average iteration count reaches the target)"
        )


class Termination:
    """One worker's view of the termination policy.

    Args:
        policy: ``master``, ``first`` or ``average``.
        board: the progress board (progress, state and liveness of every worker; a
            buffer service's ``board``). This worker is ``board.rank``.
        voters: the ranks whose progress and state count (default: every worker).
        hosts: the host of every rank (indexed by rank), when the workers span hosts:
            ``average`` then waits for a host that is behind (the module's docstring).
        lead: with ``hosts``, the share of the target this worker may lead a host's mean
            before it waits for that host (0: never waits).
        timeout: seconds one pacing wait may last.
    """

    def __init__(self, policy: str, board: ProgressBoard, voters: Sequence[int] | None = None,
                 hosts: Sequence[int] | None = None, lead: float = 0.0, timeout: float = 600.0) -> None:
        check_terminate(policy)
        self.policy = policy
        self.board = board
        self.me = board.rank
        self.voters = list(range(board.world) if voters is None else voters)
        self.hosts = list(hosts) if hosts is not None and len({hosts[r] for r in self.voters}) > 1 else None
        self.stopped = False
        self.lead, self.timeout = lead, timeout
        #: seconds this worker slept pacing the hosts
        self.paced = 0.0

    def publish(self, iteration: int) -> None:
        """Record ``iteration`` iterations done by this worker (call after each one)."""
        self.board.set_progress(iteration, STATE_DONE if self.stopped else STATE_TRAINING)

    def decide(self, iteration: int, target: int | None) -> bool:
        """True when this worker must stop after ``iteration`` iterations."""
        if self.stopped:
            return True
        if self.lead > 0 and self.hosts is not None and target is not None:
            self.pace(iteration, target)
        stop = self._decide(iteration, target)
        if stop:
            self.mark_done(iteration)
        return stop

    def mark_done(self, iteration: int) -> None:
        """Tell the peers this worker has stopped (at once, so they can follow)."""
        self.stopped = True
        self.board.set_progress(iteration, STATE_DONE)

    def _decide(self, iteration: int, target: int | None) -> bool:
        board = self.board
        reached = target is not None and iteration >= target
        if self.policy == "master":
            if self.me == MASTER or MASTER not in self.voters:
                return reached
            # The master's death ends the run too: its service would be gone anyway.
            return board.state(MASTER) == STATE_DONE or not board.alive(MASTER)
        if self.policy == "first":
            if reached:
                return True
            # DONE is written only by a worker that finished: a killed one stays TRAINING.
            return any(board.state(r) == STATE_DONE for r in self.voters if r != self.me)
        if target is None:
            return False
        # A peer still training finishes the iteration it is in (none stops mid-way). Once
        # this worker has done its own target it counts those too, so the total lands on
        # workers x target instead of up to one more per worker (two workers of equal speed
        # ran target + 1 each); below its target it counts only what is done, so a worker
        # that may still be needed never stops on a peer's iteration that may not come.
        # Only a peer still below its target is counted ahead: such a peer stops on work
        # done alone, never on a count of its own, so the iteration counted for it is run
        # (two peers past their targets counting each other's would both stop short).
        ahead = iteration >= target
        total = iteration
        for r in self.voters:
            if r != self.me:
                done = board.progress(r)
                total += done + int(ahead and done < target and board.state(r) == STATE_TRAINING
                                    and board.alive(r))
        return total >= target * len(self.voters) and not self.host_behind(iteration, target)

    def pace(self, iteration: int, target: int) -> None:
        """Sleep while this worker leads some host's mean by more than ``lead x target``
        iterations (the module's docstring); never past ``timeout`` seconds."""
        start = time.monotonic()
        bound = max(1.0, self.lead * target)
        delay = 0.001
        while (means := self._host_means(iteration)) and iteration - min(means.values()) > bound:
            if time.monotonic() - start > self.timeout:
                break
            time.sleep(delay)
            delay = min(2 * delay, 0.02)
        self.paced += time.monotonic() - start

    def _host_means(self, iteration: int) -> dict[int, float]:
        """Per host, the mean count of its live training workers (this one at ``iteration``)."""
        board, counts = self.board, {}
        for r in self.voters:
            if r == self.me:
                done = iteration
            elif board.alive(r) and board.state(r) == STATE_TRAINING:
                done = board.progress(r)
            else:
                continue
            counts.setdefault(self.hosts[r], []).append(done)
        return {host: sum(done) / len(done) for host, done in counts.items()}

    def host_behind(self, iteration: int, target: int) -> int | None:
        """The first host whose live training workers (this one included, at ``iteration``)
        have done less than ``MIN_HOST_SHARE x target`` on average; None when none has (or
        the workers are on one host)."""
        if self.hosts is None:
            return None
        for host, mean in sorted(self._host_means(iteration).items()):
            if mean < MIN_HOST_SHARE * target:
                return host
        return None
