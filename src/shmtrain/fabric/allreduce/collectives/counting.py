"""The counting transport: run a schedule for every rank at once, move no data.

It tallies, per rank and per phase, the rounds a rank takes part in (latency steps),
the bytes it sends inside its group and across groups (the beta_1 and beta_2 terms
of swCaffe eqs. (2)-(6)), and the bytes it reduces (the gamma term). Given link costs
it also runs the clock: a transfer that leaves rank s when s's clock reads t arrives
at t + alpha + beta * bytes (beta of its link class); a rank's clock after a round is
the later of "my sends are out" and "my receives are in", plus gamma per reduced byte.
The predicted time is the latest clock, i.e. the critical path through the schedule,
which for the symmetric algorithms equals the closed forms of eqs. (2)-(6).

Nothing of size ``numel`` is ever allocated: 1024 nodes x 232 MB costs a few numpy
operations per round.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from shmtrain.fabric.allreduce.collectives.schedule import Round, Topology


class LinkCosts(Protocol):
    """The alpha-beta-gamma cost model (seconds, seconds per byte)."""

    alpha: float
    beta_inside: float
    beta_across: float
    gamma: float


@dataclass
class PhaseTally:
    """Per-rank totals of one phase (arrays indexed by rank)."""

    steps: np.ndarray
    bytes_inside: np.ndarray
    bytes_across: np.ndarray
    bytes_reduced: np.ndarray


@dataclass
class Tally:
    """What a schedule costs, per rank and per phase (see :class:`CountingTransport`)."""

    world_size: int
    itemsize: int
    phases: dict[str, PhaseTally] = field(default_factory=dict)
    clock: np.ndarray | None = None

    def _total(self, name: str) -> np.ndarray:
        total = np.zeros(self.world_size, dtype=np.int64)
        for tally in self.phases.values():
            total += getattr(tally, name)
        return total

    @property
    def steps(self) -> int:
        """Rounds the busiest rank takes part in, over the whole schedule."""
        return int(self._total("steps").max(initial=0))

    @property
    def bytes_inside(self) -> int:
        """Bytes sent inside groups by the rank that sends the most of them."""
        return int(self._total("bytes_inside").max(initial=0))

    @property
    def bytes_across(self) -> int:
        """Bytes sent across groups by the rank that sends the most of them."""
        return int(self._total("bytes_across").max(initial=0))

    @property
    def bytes_reduced(self) -> int:
        """Bytes added into its buffer by the rank that reduces the most."""
        return int(self._total("bytes_reduced").max(initial=0))

    def phase(self, name: str) -> dict[str, int]:
        """Maxima over ranks of one phase's steps and bytes (zeros if it never ran)."""
        tally = self.phases.get(name)
        if tally is None:
            return {"steps": 0, "bytes_inside": 0, "bytes_across": 0, "bytes_reduced": 0}
        return {
            key: int(getattr(tally, key).max(initial=0))
            for key in ("steps", "bytes_inside", "bytes_across", "bytes_reduced")
        }

    @property
    def predicted_s(self) -> float:
        """Time at which the last rank finishes (needs link costs)."""
        if self.clock is None:
            raise ValueError("no link costs were given to the counting transport")
        return float(self.clock.max(initial=0.0))


class CountingTransport:
    """Tally a schedule's steps and bytes per link class, optionally its time.

    Args:
        topology: which group each rank is in (link class: inside or across groups).
        itemsize: bytes per element.
        costs: alpha, beta_inside, beta_across, gamma; None to count only.
    """

    def __init__(self, topology: Topology, itemsize: int = 4, costs: LinkCosts | None = None):
        self.topology = topology
        self.group_of = np.asarray(topology.group_of, dtype=np.int64)
        self.itemsize = itemsize
        self.costs = costs

    def run(self, rounds: Iterable[Round]) -> Tally:
        p = self.topology.world_size
        tally = Tally(p, self.itemsize)
        costs = self.costs
        clock = np.zeros(p) if costs is not None else None
        for rnd in rounds:
            if len(rnd) == 0:
                continue
            phase = tally.phases.get(rnd.phase)
            if phase is None:
                zeros = [np.zeros(p, dtype=np.int64) for _ in range(4)]
                phase = tally.phases[rnd.phase] = PhaseTally(*zeros)
            nbytes = (rnd.stop - rnd.start) * self.itemsize
            across = self.group_of[rnd.src] != self.group_of[rnd.dst]
            inside = ~across
            phase.bytes_inside += np.bincount(
                rnd.src[inside], weights=nbytes[inside], minlength=p
            ).astype(np.int64)
            phase.bytes_across += np.bincount(
                rnd.src[across], weights=nbytes[across], minlength=p
            ).astype(np.int64)
            reduced = np.bincount(rnd.dst, weights=nbytes * rnd.reduce, minlength=p)
            phase.bytes_reduced += reduced.astype(np.int64)
            busy = (np.bincount(rnd.src, minlength=p) + np.bincount(rnd.dst, minlength=p)) > 0
            phase.steps += busy
            if clock is not None:
                beta = np.where(across, costs.beta_across, costs.beta_inside)
                wire = costs.alpha + beta * nbytes
                # Sends from one rank in one round go out one after another.
                sending = clock + np.bincount(rnd.src, weights=wire, minlength=p)
                arrival = np.full(p, -np.inf)
                np.maximum.at(arrival, rnd.dst, clock[rnd.src] + wire)
                done = np.maximum(sending, arrival) + costs.gamma * reduced
                clock = np.where(busy, done, clock)
        tally.clock = clock
        return tally
