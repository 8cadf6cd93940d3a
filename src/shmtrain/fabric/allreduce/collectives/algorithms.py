"""Allreduce algorithms as schedules (rounds of transfers), swCaffe Section V-A.

Each builder returns the rounds of one sum-allreduce of ``numel`` elements over the
ranks of a :class:`Topology`; the executor (real data) and the counting transport (no
data) both run them. Building blocks take ``members``, the physical ranks in the
algorithm's logical order, so the same code runs over all ranks, over one group, or
over the group leaders.

- ``ring``: reduce-scatter then allgather around a ring, 2(p-1) rounds of n/p
  (Patarasuk & Yuan, swCaffe ref. [15]).
- ``rhd``: reduce-scatter by recursive halving, allgather by recursive doubling
  (Rabenseifner; swCaffe eqs. (2)-(4), left of Fig. 7), log2 p rounds per phase; a
  non-power-of-two p first folds the first 2r ranks pairwise (r = p - 2^floor(log2 p)).
- ``tree``: binomial-tree reduce to rank 0, then binomial-tree broadcast (the
  CaffeGPI trees; swCaffe's "binomial-tree-based" baseline), 2 ceil(log2 p) rounds of n.
- ``topo``: ``rhd`` over logical ranks assigned round-robin across groups (swCaffe
  eqs. (5)-(6), right of Fig. 7): the heavy first halving steps and last doubling steps
  stay inside a group; only the last log2(p/q) halving and first log2(p/q) doubling
  steps, carrying (p/q - 1) n/p bytes in all, cross groups.
- ``hierarchical``: binomial reduce inside each group to its first rank, ``rhd`` among
  those leaders, binomial broadcast inside each group (the HSGD pattern of ShmCaffe:
  inside the host, then across hosts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

from shmtrain.fabric.allreduce.collectives.schedule import Round, Topology, parallel

Builder = Callable[[Topology, int], Iterator[Round]]


def _bounds(lo: int, hi: int, parts: int) -> np.ndarray:
    """Boundaries of ``parts`` near-equal contiguous chunks of ``[lo, hi)``."""
    return lo + (np.arange(parts + 1, dtype=np.int64) * (hi - lo)) // parts


def ring_rounds(members: Sequence[int], lo: int, hi: int) -> Iterator[Round]:
    """Ring reduce-scatter (p-1 rounds, reduce) then ring allgather (p-1 rounds, copy)."""
    m = np.asarray(members, dtype=np.int64)
    p = len(m)
    if p < 2:
        return
    bounds = _bounds(lo, hi, p)
    i = np.arange(p)
    right = m[(i + 1) % p]
    for k in range(p - 1):  # rank i sends chunk i-k; after p-1 rounds it holds chunk i+1
        c = (i - k) % p
        yield Round.make(m, right, bounds[c], bounds[c + 1], True, "reduce-scatter")
    for k in range(p - 1):
        c = (i + 1 - k) % p
        yield Round.make(m, right, bounds[c], bounds[c + 1], False, "allgather")


def rhd_rounds(members: Sequence[int], lo: int, hi: int) -> Iterator[Round]:
    """Recursive halving reduce-scatter + recursive doubling allgather (eqs. (3)-(4)).

    With p = 2^k + r (r < 2^k), ranks 2i and 2i+1 (i < r) first fold: 2i sends its whole
    buffer to 2i+1 and sits out; the 2^k remaining ranks run the power-of-two algorithm;
    at the end 2i+1 returns the result to 2i. That adds two rounds of n.
    """
    m = np.asarray(members, dtype=np.int64)
    p = len(m)
    if p < 2:
        return
    core_size = 1 << (p.bit_length() - 1)
    extra = p - core_size
    if extra:
        yield Round.make(m[0 : 2 * extra : 2], m[1 : 2 * extra : 2], lo, hi, True, "fold")
        core = np.concatenate([m[1 : 2 * extra : 2], m[2 * extra :]])
    else:
        core = m
    bounds = _bounds(lo, hi, core_size)
    logical = np.arange(core_size)
    distance = core_size // 2
    while distance >= 1:  # halving: keep the half that holds my final block
        partner = logical ^ distance
        first = (partner // distance) * distance  # the partner's half, sent to it
        yield Round.make(
            core, core[partner], bounds[first], bounds[first + distance], True, "reduce-scatter"
        )
        distance //= 2
    distance = 1
    while distance < core_size:  # doubling: send all I hold, receive the partner's
        partner = logical ^ distance
        first = (logical // distance) * distance
        yield Round.make(
            core, core[partner], bounds[first], bounds[first + distance], False, "allgather"
        )
        distance *= 2
    if extra:
        yield Round.make(m[1 : 2 * extra : 2], m[0 : 2 * extra : 2], lo, hi, False, "unfold")


def tree_reduce_rounds(members: Sequence[int], lo: int, hi: int) -> Iterator[Round]:
    """Binomial-tree reduce to ``members[0]``: in round k, logical rank i with
    i mod 2^(k+1) = 2^k sends everything to i - 2^k (higher ranks to lower)."""
    m = np.asarray(members, dtype=np.int64)
    p = len(m)
    step = 1
    while step < p:
        i = np.arange(step, p, 2 * step)
        yield Round.make(m[i], m[i - step], lo, hi, True, "reduce")
        step *= 2


def tree_broadcast_rounds(members: Sequence[int], lo: int, hi: int) -> Iterator[Round]:
    """Binomial-tree broadcast from ``members[0]``, the reduce tree run backwards."""
    m = np.asarray(members, dtype=np.int64)
    p = len(m)
    step = 1
    while step < p:
        step *= 2
    step //= 2
    while step >= 1:
        i = np.arange(0, p - step, 2 * step)
        yield Round.make(m[i], m[i + step], lo, hi, False, "broadcast")
        step //= 2


def _relabel(rounds: Iterator[Round], prefix: str) -> Iterator[Round]:
    for rnd in rounds:
        yield Round(rnd.src, rnd.dst, rnd.start, rnd.stop, rnd.reduce, f"{prefix}{rnd.phase}")


def ring(topology: Topology, numel: int) -> Iterator[Round]:
    """Ring allreduce over ranks in rank order."""
    return ring_rounds(range(topology.world_size), 0, numel)


def rhd(topology: Topology, numel: int) -> Iterator[Round]:
    """Recursive halving/doubling over ranks in rank order (adjacent ranks share a group)."""
    return rhd_rounds(range(topology.world_size), 0, numel)


def tree(topology: Topology, numel: int) -> Iterator[Round]:
    """Binomial reduce to rank 0, then binomial broadcast."""
    members = range(topology.world_size)
    yield from tree_reduce_rounds(members, 0, numel)
    yield from tree_broadcast_rounds(members, 0, numel)


def topo(topology: Topology, numel: int) -> Iterator[Round]:
    """Topology-aware recursive halving/doubling: round-robin logical numbering (Fig. 7)."""
    return rhd_rounds(topology.round_robin(), 0, numel)


def hierarchical(topology: Topology, numel: int) -> Iterator[Round]:
    """Reduce inside each group, allreduce among group leaders, broadcast inside groups."""
    groups = topology.groups()
    yield from _relabel(parallel(tree_reduce_rounds(g, 0, numel) for g in groups), "intra-")
    yield from _relabel(rhd_rounds([g[0] for g in groups], 0, numel), "across-")
    yield from _relabel(parallel(tree_broadcast_rounds(g, 0, numel) for g in groups), "intra-")


#: every schedule-based allreduce, by the name ``--allreduce`` and ``shmtrain sim`` use
ALGORITHMS: dict[str, Builder] = {
    "ring": ring,
    "rhd": rhd,
    "tree": tree,
    "topo": topo,
    "hierarchical": hierarchical,
}


def get_algorithm(name: str) -> Builder:
    """The schedule builder called ``name``; a clear error for an unknown one."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(
            f"unknown allreduce algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}"
        ) from None
