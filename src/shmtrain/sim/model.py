"""The alpha-beta-gamma cost model with two link classes (swCaffe Section V-A).

Sending n bytes costs ``alpha + beta * n``; ``beta`` is ``beta_inside`` between two
nodes of one group (supernode, host) and ``beta_across`` between groups, where the
links are over-subscribed (the paper measures about 1/4 of full bandwidth across
supernodes, so ``beta_across ~ 4 beta_inside``; its text writes the ratio upside
down). Reducing costs ``gamma`` per byte.

The defaults are assumptions in the spirit of the paper, not measurements: 5 us per
message (a high-latency network), 6 GB/s inside a group (Infiniband-FDR class), a
quarter of that across groups, 10 GB/s for the local sum. Pass your own.

The closed forms of eqs. (2)-(6) are here too, so tests can hold the simulator to them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class CostModel:
    """Seconds per message (``alpha``) and per byte (``beta_inside``, ``beta_across``,
    ``gamma``)."""

    alpha: float = 5e-6
    beta_inside: float = 1 / 6e9
    beta_across: float = 4 / 6e9
    gamma: float = 1 / 10e9

    def __post_init__(self) -> None:
        for name in ("alpha", "beta_inside", "beta_across", "gamma"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"{flag} {value!r} must be a finite number of seconds >= 0 "
                    f"(e.g. {flag} {getattr(CostModel(), name):.3g})"
                )


def _check_power_of_two(nodes: int, group_size: int) -> None:
    for what, v in (("nodes", nodes), ("groups", nodes // group_size), ("group size", group_size)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"the closed forms need powers of two; {what} = {v}")


def rhd_closed_form(nodes: int, group_size: int, nbytes: float, m: CostModel) -> dict[str, float]:
    """Plain recursive halving/doubling, adjacent numbering: eqs. (2)-(4).

    Per phase: log2 p steps, (q-1) n/p bytes inside and (p-q) n/p across groups.
    """
    _check_power_of_two(nodes, group_size)
    p, q, n = nodes, group_size, nbytes
    inside, across = (q - 1) * n / p, (p - q) * n / p
    return _phases(p, inside, across, n, m)


def topo_closed_form(nodes: int, group_size: int, nbytes: float, m: CostModel) -> dict[str, float]:
    """Topology-aware recursive halving/doubling, round-robin numbering: eqs. (5)-(6).

    Per phase: log2 p steps, (p - p/q) n/p bytes inside and (p/q - 1) n/p across.
    """
    _check_power_of_two(nodes, group_size)
    p, q, n = nodes, group_size, nbytes
    inside, across = (p - p // q) * n / p, (p // q - 1) * n / p
    return _phases(p, inside, across, n, m)


def _phases(p: int, inside: float, across: float, n: float, m: CostModel) -> dict[str, float]:
    steps = int(math.log2(p))
    allgather = steps * m.alpha + inside * m.beta_inside + across * m.beta_across
    reduce_scatter = allgather + (p - 1) / p * n * m.gamma
    return {
        "steps_per_phase": steps,
        "bytes_inside_per_phase": inside,
        "bytes_across_per_phase": across,
        "reduce_scatter_s": reduce_scatter,
        "allgather_s": allgather,
        "allreduce_s": reduce_scatter + allgather,
    }
