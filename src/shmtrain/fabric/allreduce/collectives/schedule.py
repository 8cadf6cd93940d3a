"""Communication schedules: an allreduce written once as rounds of transfers.

A schedule is a sequence of :class:`Round` s. A round is a set of transfers, each
"send elements ``[start, stop)`` of the source's buffer to ``dst``, which adds them
into (``reduce``) or copies them onto the same range of its own buffer". Every rank
takes part in the rounds in order; inside a round a rank posts all its sends and
receives at once, so an exchange (send to a partner while receiving from it) is one
round. Sends read the buffer as it was at the start of the round.

The same rounds are executed by real transports (:func:`shmtrain.fabric.allreduce.collectives.
executor.execute`, one rank at a time) and tallied by the counting transport
(:class:`shmtrain.fabric.allreduce.collectives.counting.CountingTransport`, all ranks at once,
no data), so the simulator (SCALE, swCaffe Section V-A) measures the very schedule
that trains. Transfers are stored as numpy arrays, one entry per transfer, so a round
of 1024 nodes costs a few vector operations.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import zip_longest

import numpy as np


@dataclass(frozen=True, slots=True)
class Round:
    """One communication round: parallel transfers, one array entry per transfer."""

    src: np.ndarray  # int64 rank that sends
    dst: np.ndarray  # int64 rank that receives
    start: np.ndarray  # int64 first element (same offsets in source and destination)
    stop: np.ndarray  # int64 one past the last element
    reduce: np.ndarray  # bool: add into the destination (True) or copy onto it (False)
    phase: str  # e.g. "reduce-scatter", "allgather", "reduce", "broadcast"

    @classmethod
    def make(cls, src, dst, start, stop, reduce, phase: str) -> Round:
        n = len(np.atleast_1d(src))

        def arr(x, dtype):
            return np.broadcast_to(np.asarray(x, dtype=dtype), (n,)).copy()

        return cls(
            arr(src, np.int64), arr(dst, np.int64), arr(start, np.int64),
            arr(stop, np.int64), arr(reduce, bool), phase,
        )

    def __len__(self) -> int:
        return len(self.src)


def merge(rounds: Sequence[Round]) -> Round:
    """Rounds of disjoint rank sets run side by side, as one round."""
    if len(rounds) == 1:
        return rounds[0]
    return Round(
        np.concatenate([r.src for r in rounds]),
        np.concatenate([r.dst for r in rounds]),
        np.concatenate([r.start for r in rounds]),
        np.concatenate([r.stop for r in rounds]),
        np.concatenate([r.reduce for r in rounds]),
        rounds[0].phase,
    )


def parallel(schedules: Iterable[Iterable[Round]]) -> Iterator[Round]:
    """Run schedules over disjoint sets of ranks side by side, round k with round k."""
    for group in zip_longest(*schedules):
        yield merge([r for r in group if r is not None])


@dataclass(frozen=True, slots=True)
class Topology:
    """Which group (host, supernode) each rank belongs to.

    ``group_of[r]`` is rank ``r``'s group id. Groups are listed in order of their
    smallest rank; members of a group in rank order.
    """

    group_of: tuple[int, ...]

    @classmethod
    def uniform(cls, world_size: int, group_size: int) -> Topology:
        """Contiguous groups: ranks ``[k*q, (k+1)*q)`` form group ``k`` (torchrun's layout)."""
        if world_size < 1:
            raise ValueError(f"world size {world_size} must be at least 1")
        if group_size < 1 or world_size % group_size:
            raise ValueError(
                f"group size {group_size} must be at least 1 and divide the number of "
                f"nodes {world_size}; pick a divisor of {world_size}"
            )
        return cls(tuple(r // group_size for r in range(world_size)))

    @classmethod
    def single(cls, world_size: int) -> Topology:
        return cls((0,) * world_size)

    @property
    def world_size(self) -> int:
        return len(self.group_of)

    def groups(self) -> list[list[int]]:
        members: dict[int, list[int]] = {}
        for rank, g in enumerate(self.group_of):
            members.setdefault(g, []).append(rank)
        return list(members.values())

    def round_robin(self) -> list[int]:
        """Ranks in topology-aware logical order (swCaffe Fig. 7): the i-th member of
        every group, then the (i+1)-th, ...; logical rank ``l`` lies in group ``l mod G``.
        """
        groups = self.groups()
        width = max(len(g) for g in groups)
        return [g[i] for i in range(width) for g in groups if i < len(g)]


@dataclass(frozen=True, slots=True)
class RankRound:
    """One round as one rank sees it: what to send where, what to receive from whom."""

    sends: tuple[tuple[int, int, int], ...]  # (peer, start, stop)
    recvs: tuple[tuple[int, int, int, bool], ...]  # (peer, start, stop, reduce)


def plan_for(rounds: Iterable[Round], rank: int) -> list[RankRound]:
    """The rounds ``rank`` takes part in, with empty transfers left out on both sides."""
    plan = []
    for rnd in rounds:
        nonempty = rnd.stop > rnd.start
        mine_s = np.flatnonzero((rnd.src == rank) & nonempty)
        mine_r = np.flatnonzero((rnd.dst == rank) & nonempty)
        if len(mine_s) == 0 and len(mine_r) == 0:
            continue
        sends = tuple((int(rnd.dst[i]), int(rnd.start[i]), int(rnd.stop[i])) for i in mine_s)
        recvs = tuple(
            (int(rnd.src[i]), int(rnd.start[i]), int(rnd.stop[i]), bool(rnd.reduce[i]))
            for i in mine_r
        )
        plan.append(RankRound(sends, recvs))
    return plan


def check(rounds: Iterable[Round], world_size: int, numel: int) -> None:
    """Raise ``ValueError`` if a schedule is malformed: ranks out of range, ranges
    outside the buffer, a rank sending to itself, or a rank receiving onto a range it
    sends in the same round (the send would read data the receive overwrites).
    """
    for k, rnd in enumerate(rounds):
        if len(rnd) == 0:
            continue
        if rnd.src.min() < 0 or rnd.dst.min() < 0 or max(rnd.src.max(), rnd.dst.max()) >= world_size:
            raise ValueError(f"round {k} ({rnd.phase}): rank out of range 0..{world_size - 1}")
        if (rnd.src == rnd.dst).any():
            raise ValueError(f"round {k} ({rnd.phase}): a rank sends to itself")
        if rnd.start.min() < 0 or rnd.stop.max() > numel or (rnd.stop < rnd.start).any():
            raise ValueError(f"round {k} ({rnd.phase}): range outside [0, {numel})")
        for i in range(len(rnd)):
            if rnd.start[i] == rnd.stop[i]:
                continue
            d = rnd.dst[i]
            clash = (rnd.src == d) & (rnd.start < rnd.stop[i]) & (rnd.stop > rnd.start[i])
            if clash.any():
                raise ValueError(
                    f"round {k} ({rnd.phase}): rank {d} receives [{rnd.start[i]}, "
                    f"{rnd.stop[i]}) while sending an overlapping range"
                )
