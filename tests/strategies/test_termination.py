"""Termination alignment (TERM, ShmCaffe Section III-E): the three policies."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from shmtrain.fabric.shm.control import LINE, ControlBlock, PeerFailure
from shmtrain.fabric.shm.segment import SharedSegment
from shmtrain.fabric.smb import STATE_DONE, STATE_TRAINING, ProgressBoard
from shmtrain.parallel.data_parallel import DataParallel
from shmtrain.runtime.launch.launcher import launch
from shmtrain.strategies.elastic.termination import Termination
from support.reference import batches, tiny_model, worker_batch


class FakeBoard(ProgressBoard):
    """A progress board in memory, for policy unit tests."""

    def __init__(self, rank: int, progress: list[int], states: list[int], alive: list[bool] | None = None):
        self.rank, self.world = rank, len(progress)
        self._progress, self._states = list(progress), list(states)
        self._alive = alive or [True] * self.world

    def set_progress(self, iterations: int, state: int | None = None) -> None:
        self._progress[self.rank] = iterations
        if state is not None:
            self._states[self.rank] = state

    def progress(self, rank: int) -> int:
        return self._progress[rank]

    def state(self, rank: int) -> int:
        return self._states[rank]

    def alive(self, rank: int) -> bool:
        return self._alive[rank]


T, D = STATE_TRAINING, STATE_DONE


def test_master_policy() -> None:
    assert Termination("master", FakeBoard(0, [9, 3, 3], [T, T, T])).decide(10, 10)
    assert not Termination("master", FakeBoard(0, [8, 30, 30], [T, T, T])).decide(9, 10)
    # a non-master runs past its own target until the master has finished...
    assert not Termination("master", FakeBoard(1, [5, 12, 3], [T, T, T])).decide(20, 10)
    assert Termination("master", FakeBoard(1, [10, 12, 3], [D, T, T])).decide(3, 10)
    # ...or died (its buffer service went with it)
    assert Termination("master", FakeBoard(1, [4, 1, 1], [T, T, T], [False, True, True])).decide(1, 10)


def test_first_policy() -> None:
    assert Termination("first", FakeBoard(1, [2, 10, 3], [T, T, T])).decide(10, 10)
    assert Termination("first", FakeBoard(1, [10, 2, 3], [D, T, T])).decide(2, 10)
    assert not Termination("first", FakeBoard(1, [2, 2, 3], [T, T, T])).decide(2, 10)
    # a killed worker never finished: it does not end the others
    dead = FakeBoard(0, [2, 2, 4], [T, T, T], [True, True, False])
    assert not Termination("first", dead).decide(2, 10)


def test_average_policy() -> None:
    # past its target, a worker counts the iteration each training peer is in: 10 + 9 + 10 < 30
    assert not Termination("average", FakeBoard(0, [0, 8, 9], [T, T, T])).decide(10, 10)
    assert Termination("average", FakeBoard(0, [0, 8, 9], [T, T, T])).decide(11, 10)  # 11 + 9 + 10
    # below its target, only what is done: 9 + 10 + 10 (not 9 + 11 + 11)
    assert not Termination("average", FakeBoard(0, [0, 10, 10], [T, T, T])).decide(9, 10)
    # a finished peer has no iteration in flight: 10 + 10 + 9 < 30
    assert not Termination("average", FakeBoard(0, [0, 10, 9], [T, D, D])).decide(10, 10)
    # a dead worker's frozen count stays in the mean (nothing in flight): the survivors make up for it
    assert not Termination("average", FakeBoard(0, [0, 9, 2], [T, T, T], [True, True, False])).decide(17, 10)
    board = FakeBoard(0, [0, 9, 2], [T, T, T], [True, True, False])
    assert Termination("average", board).decide(18, 10)  # 18 + (9 + 1) + 2
    # a peer past its own target may stop on its own count: its iteration in flight is not
    # counted (two such peers counting each other's would both stop short of the total)
    assert not Termination("average", FakeBoard(0, [0, 12, 2], [T, T, T], [True, True, False])).decide(15, 10)
    assert Termination("average", FakeBoard(0, [0, 12, 2], [T, T, T], [True, True, False])).decide(16, 10)
    assert not Termination("average", FakeBoard(0, [0, 5, 5], [T, T, T])).decide(10**6, None)


def test_average_across_hosts_waits_for_a_host_that_is_behind() -> None:
    """Workers 0, 1 on host 0, 2, 3 on host 1: the total (4 x 10) is reached by host 0
    alone, but host 1's training workers have done less than half their share (mean 2 <
    5), so nobody stops; once host 1's mean reaches 5 the job ends; without ``hosts`` (or
    on one host) the total alone decides, as before."""
    hosts = [0, 0, 1, 1]
    behind = [38, 38, 2, 2]
    assert Termination("average", FakeBoard(0, behind, [T] * 4)).decide(38, 10)  # one host's rule
    assert not Termination("average", FakeBoard(0, behind, [T] * 4), hosts=hosts).decide(38, 10)
    assert not Termination("average", FakeBoard(2, behind, [T] * 4), hosts=hosts).decide(2, 10)  # the slow host too
    assert Termination("average", FakeBoard(0, [30, 30, 5, 5], [T] * 4), hosts=hosts).decide(30, 10)
    assert Termination("average", FakeBoard(2, [30, 30, 5, 5], [T] * 4), hosts=hosts).decide(5, 10)
    # the total still has to be reached: a host at its share ends nothing early
    assert not Termination("average", FakeBoard(0, [6, 6, 6, 6], [T] * 4), hosts=hosts).decide(6, 10)
    # on one host (every rank's host the same) nothing changes
    assert Termination("average", FakeBoard(0, behind, [T] * 4), hosts=[0] * 4).decide(38, 10)


def test_average_across_hosts_never_waits_for_a_dead_or_finished_host() -> None:
    """A host whose workers died (the board's alive()) or finished is not waited for, so a
    lost host does not hold the job; one live worker of a host keeps it counted."""
    hosts = [0, 0, 1, 1]
    dead = FakeBoard(0, [38, 38, 2, 2], [T] * 4, [True, True, False, False])
    assert Termination("average", dead, hosts=hosts).decide(38, 10)
    finished = FakeBoard(0, [38, 38, 2, 2], [T, T, D, D])
    assert Termination("average", finished, hosts=hosts).decide(38, 10)
    one_left = FakeBoard(0, [38, 38, 2, 2], [T] * 4, [True, True, False, True])
    assert not Termination("average", one_left, hosts=hosts).decide(38, 10)
    # the other policies are untouched by hosts
    assert Termination("first", FakeBoard(0, [2, 2, 2, 2], [T] * 4), hosts=hosts).decide(10, 10)
    assert Termination("master", FakeBoard(0, [2, 2, 2, 2], [T] * 4), hosts=hosts).decide(10, 10)


class CatchingUp(FakeBoard):
    """Ranks 2 and 3 (host 1) advance by one iteration each time rank 2's count is read."""

    def progress(self, rank: int) -> int:
        if rank == 2:
            self._progress[2] += 1
            self._progress[3] += 1
        return self._progress[rank]


def test_host_lead_paces_a_worker_ahead_until_the_host_behind_catches_up() -> None:
    """``--host-lead 0.1``, target 100: rank 0 at 50 leads host 1 (mean 20) by 30 > 10, so
    it sleeps in decide() until host 1's mean is within 10 (read by read, host 1 moves)."""
    board = CatchingUp(0, [50, 50, 20, 20], [T] * 4)
    term = Termination("average", board, hosts=[0, 0, 1, 1], lead=0.1)
    assert not term.decide(50, 100)
    assert 40 <= board._progress[2] <= 41 and term.paced > 0
    # within the lead, or without hosts, or lead 0: no wait
    for term in (Termination("average", FakeBoard(0, [50, 50, 45, 45], [T] * 4), hosts=[0, 0, 1, 1], lead=0.1),
                 Termination("average", CatchingUp(0, [50, 50, 20, 20], [T] * 4), lead=0.1),
                 Termination("average", CatchingUp(0, [50, 50, 20, 20], [T] * 4), hosts=[0, 0, 1, 1])):
        assert not term.decide(50, 100) and term.paced < 0.05


def test_host_lead_never_waits_for_a_dead_or_finished_host_nor_past_its_timeout() -> None:
    hosts = [0, 0, 1, 1]
    dead = Termination("average", FakeBoard(0, [50, 50, 2, 2], [T] * 4, [True, True, False, False]),
                       hosts=hosts, lead=0.01)
    finished = Termination("average", FakeBoard(0, [50, 50, 2, 2], [T, T, D, D]), hosts=hosts, lead=0.01)
    for term in (dead, finished):
        start = time.monotonic()
        term.decide(50, 100)
        assert time.monotonic() - start < 0.5
    stuck = Termination("average", FakeBoard(0, [50, 50, 2, 2], [T] * 4), hosts=hosts, lead=0.01, timeout=0.3)
    start = time.monotonic()
    assert not stuck.decide(50, 100)  # it gave up waiting and trains on
    assert 0.3 <= time.monotonic() - start < 2.0


def test_decision_is_published_and_sticky() -> None:
    board = FakeBoard(2, [10, 10, 0], [T, T, T])
    term = Termination("average", board)
    assert term.decide(10, 10) and board.state(2) == STATE_DONE and board.progress(2) == 10
    assert term.decide(10, 10)


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="--terminate 'last'.*master, first, average"):
        Termination("last", FakeBoard(0, [0], [T]))


# -- every worker ends, with the counts the policy promises -----------------------------
def paced_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    target, delay = payload["target"], payload["delays"][ctx.rank]
    x, y = batches(8, 4, seed=ctx.rank)
    model = tiny_model()
    dp = DataParallel(model, torch.optim.SGD(model.parameters(), lr=0.05), payload["strategy"],
                      ctx=ctx, terminate=payload["policy"], **payload.get("options", {}))
    dp.strategy.target_iterations = target
    while not dp.should_stop():
        xs, ys = worker_batch(x, y, dp.strategy.iteration % 8, 0, 4, 1)
        dp.zero_grad()
        nn.functional.cross_entropy(dp(xs), ys).backward()
        dp.step()
        time.sleep(delay)  # a slower or faster worker (sleeping, so load does not blur it)
    dp.close()
    return dp.strategy.iteration


TARGET = 15


def test_master_policy_ends_everyone_with_the_master() -> None:
    counts = launch("strategies.test_termination:paced_worker", 3,
                    {"strategy": "seasgd", "policy": "master", "target": TARGET, "delays": [0.08, 0.005, 0.005]})
    assert counts[0] == TARGET
    assert counts[1] > TARGET and counts[2] > TARGET  # faster workers ran past their own target


def test_first_policy_ends_everyone_with_the_first_finisher() -> None:
    counts = launch("strategies.test_termination:paced_worker", 3,
                    {"strategy": "seasgd", "policy": "first", "target": TARGET, "delays": [0.06, 0.0, 0.06]})
    assert counts[1] == TARGET and max(counts) == TARGET
    assert min(counts) < TARGET  # the slow ones stopped early


def test_average_policy_reaches_the_target_on_average() -> None:
    workers = 3
    counts = launch("strategies.test_termination:paced_worker", workers,
                    {"strategy": "easgd", "policy": "average", "target": TARGET, "delays": [0.0, 0.03, 0.08]})
    assert TARGET * workers <= sum(counts) <= TARGET * workers + workers  # within one per worker
    assert min(counts) < TARGET < max(counts)


def test_hsgd_groups_follow_their_root() -> None:
    counts = launch("strategies.test_termination:paced_worker", 4,
                    {"strategy": "hsgd", "policy": "average", "target": TARGET, "delays": [0.0, 0.0, 0.05, 0.05],
                     "options": {"groups": 2, "group_size": 2}})
    assert counts[0] == counts[1] and counts[2] == counts[3]
    assert TARGET * 4 <= sum(counts) <= TARGET * 4 + 4


def eager_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    """As :func:`paced_worker`, but deciding right after its step (as ``shmtrain train``'s
    loop does), so a peer's last iteration is usually still under way at the decision."""
    target, delay = payload["target"], payload["delays"][ctx.rank]
    x, y = batches(8, 4, seed=ctx.rank)
    model = tiny_model()
    dp = DataParallel(model, torch.optim.SGD(model.parameters(), lr=0.05), payload["strategy"],
                      ctx=ctx, terminate="average", **payload.get("options", {}))
    dp.strategy.target_iterations = target
    while not dp.should_stop():
        time.sleep(delay)
        xs, ys = worker_batch(x, y, dp.strategy.iteration % 8, 0, 4, 1)
        dp.zero_grad()
        nn.functional.cross_entropy(dp(xs), ys).backward()
        dp.step()
    dp.close()
    return dp.strategy.iteration


@pytest.mark.parametrize(("strategy", "options"), [("seasgd", {}), ("hsgd", {"groups": 2, "group_size": 1})])
def test_average_policy_at_equal_speed_runs_the_target_exactly(strategy: str, options: dict) -> None:
    """Two workers of one speed: the first to reach the target counts the other's
    iteration under way, so neither runs target + 1 (`--iterations 5` ran 6 before)."""
    counts = launch("strategies.test_termination:eager_worker", 2,
                    {"strategy": strategy, "target": TARGET, "delays": [0.03, 0.03], "options": options})
    assert sum(counts) == 2 * TARGET, counts


# -- a peer that posts and then finishes, between a waiter's read and its check ---------------
def _racing_block(post_first: bool) -> tuple[ControlBlock, SharedSegment]:
    """A control block of two local ranks in this process, bound to rank 1, whose first
    liveness check finds rank 0 finished after 5 steps (having posted 7 on channel 0 just
    before, when ``post_first``): the order of a group root that decides to stop and ends."""
    seg = SharedSegment(f"shmtrain-test-race-{os.getpid()}", ControlBlock.nbytes(2), create=True)
    block = ControlBlock(seg, 2, init=True)
    block.set_pid(0, os.getpid())
    block.set_pid(1, os.getpid())  # binds this process to rank 1, the waiter
    block.steps_done = lambda: 5
    check = block._check

    def peer_ends_now(rank: int, what: str) -> None:
        if post_first:
            block.post(0, 0, 7)
        block.set_finished(0, 5)
        check(rank, what)

    block._check = peer_ends_now  # type: ignore[method-assign]
    return block, seg


@pytest.mark.parametrize("post_first", [True, False])
def test_a_post_just_before_the_peer_ends_is_no_failure(post_first: bool) -> None:
    block, seg = _racing_block(post_first)
    try:
        if post_first:
            block.wait(0, [0], 6, timeout=5.0, what="the decision", spin=False)
            assert block.get(0, 0) == 7
        else:  # the peer ended without posting: that is the failure it names
            with pytest.raises(PeerFailure, match="finished after 5 steps while this worker waited for the decision"):
                block.wait(0, [0], 6, timeout=5.0, what="the decision", spin=False)
    finally:
        seg.unlink()
        seg.close()


def test_host_lead_option_is_checked_and_named() -> None:
    from shmtrain.strategies.base import build_config

    assert build_config("seasgd", {"host_lead": 0.05}).host_lead == 0.05
    with pytest.raises(ValueError, match=r"--host-lead 2 must lie in \[0, 1\]"):
        build_config("hsgd", {"host_lead": 2})


class _Host:
    """The part of a host group a one-sided window uses: two local ranks in this process,
    this one rank 1, and the control block of :func:`_racing_block`."""

    def __init__(self, control: ControlBlock, timeout: float) -> None:
        self.local_world, self.local_rank, self.control, self.timeout = 2, 1, control, timeout
        self.segments: list[SharedSegment] = []

    def allocate(self, tag: str, nbytes: int) -> SharedSegment:
        segment = SharedSegment(f"shmtrain-test-{tag}-{os.getpid()}", nbytes, create=True)
        self.segments.append(segment)
        return segment


@pytest.mark.parametrize("rang_first", [True, False])
def test_a_notification_just_before_the_sender_ends_is_no_failure(rang_first: bool) -> None:
    """The one-sided window's wait: sender 0 notifies (rings the doorbell), then finishes,
    between the receiver's test and its liveness check."""
    from shmtrain.fabric.exchanges.onesided import OneSidedWindow

    block, seg = _racing_block(post_first=False)
    host = _Host(block, 5.0)
    try:
        window = OneSidedWindow(host, 64, notifications=1, tag="window")
        check = window.check

        def sender_ends_now(senders, what: str) -> None:
            if rang_first:
                window._words[1, 0] = 3  # sender 0's write of the notification, then its ring
                window._doorbells[LINE // 4] = 12345
            block.set_finished(0, 5)
            check(senders, what)

        window.check = sender_ends_now  # type: ignore[method-assign]
        if rang_first:
            window.wait(0, 3, sender=0, timeout=5.0, what="the layer")
            assert window.test(0, 3)
        else:
            with pytest.raises(PeerFailure, match="finished after 5 steps while this worker waited for the layer"):
                window.wait(0, 3, sender=0, timeout=5.0, what="the layer")
    finally:
        for segment in [seg, *host.segments]:
            segment.unlink()
            segment.close()


def test_close_drains_the_exchange_in_flight_before_it_marks_the_rank_finished(monkeypatch) -> None:
    """A peer waiting for this rank's part of an exchange still in flight (diloco's
    --overlap-steps, on a helper thread) must find it posted before "finished"."""
    model = tiny_model()
    dp = DataParallel(model, torch.optim.SGD(model.parameters(), lr=0.05), "ssgd")
    order: list[str] = []
    control = SimpleNamespace(set_finished=lambda rank, steps: order.append("finished"))
    monkeypatch.setattr(dp, "_control", lambda: control)
    monkeypatch.setattr(dp.strategy, "quiesce", lambda: order.append("quiesce"))
    dp.close()
    assert order == ["quiesce", "finished"]
