"""Which algorithm the private-tensor allreduce runs, chosen from a cost model of the machine.

Pure: :func:`choose` takes the rank count, the message size, the element size and a
:class:`Machine` (the parameters :mod:`shmtrain.fabric.allreduce.machine_model` measures once per
machine) and returns a :class:`Plan`; nothing here touches memory or processes, so a
test can hand it a described 16-core or 2-socket host. The three algorithms, all through
the ring of cache-sized blocks of :mod:`shmtrain.fabric.allreduce.pipeline`:

``all-read`` (one hand-off per block)
    every rank copies its block into its ring slot, and once all have posted sums all
    ``L`` slots into its own tensor: ``L`` shared reads per byte (``L - 1`` at ``L = 2``).
``split`` (reduce-scatter + all-gather, two hand-offs per block)
    rank ``r`` copies in every chunk of the block but its own, sums chunk ``r`` of the
    ``L`` inputs (its own straight from its tensor) into the shared result and its tensor,
    and after the second hand-off copies the other chunks of the result out: about 2
    shared reads and 1 shared write per byte, at any ``L`` (PAR-SUM, swCaffe Section V-A).
``two-level`` (three hand-offs per block, hosts with several NUMA nodes)
    the same inside each node's group of ranks (a partial sum per group), then piece
    ``r`` of the block summed over the groups' partials, then the all-gather: the
    reduce-scatter's reads stay inside a node; only ``S`` partial pieces per rank cross.

The model: a block's bytes cost their shared traffic at one core's copy bandwidth (or
its share of the all-core bandwidth, whichever is lower; ranks beyond the cores queue
for them), reads from another NUMA node :data:`REMOTE_FACTOR` times a local one; every
hand-off costs the measured hand-off latency (spinning ranks; a sleeping one's where ranks
outnumber cores) times ``log2 L`` (a hand-off ends when the slowest of ``L`` ranks has
posted), and where ranks outnumber cores everything takes ``L / cores`` times as long.
:func:`choose` takes the cheapest plan; at ``L = 2`` all-read (its one hand-off reads
no more than the split's two).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shmtrain.fabric.shm.stitch import PAGE

ALGORITHMS = ("all-read", "split", "two-level")
#: hand-offs per block of each algorithm
HANDOFFS = {"all-read": 1, "split": 2, "two-level": 3}
#: a read from another NUMA node costs this many local ones (an assumption, not measured:
#: typical two-socket hosts read remote memory at 1/2-1/3 of local bandwidth)
REMOTE_FACTOR = 2.0
#: bounds of the block size chosen from the cache (bytes per rank and block)
MIN_BLOCK, MAX_BLOCK = 64 << 10, 512 << 10
#: elements a split boundary falls on (the compiled path's vector width, and split())
GRANULE = 16


@dataclass(frozen=True)
class Machine:
    """What the cost model knows of a host (measured by :mod:`shmtrain.fabric.allreduce.machine_model`).

    Attributes:
        nodes: the cores of each NUMA node that this process may use (non-empty tuples).
        copy_one_Bps: bytes read + written per second by one core copying (cache-warm).
        copy_all_Bps: the same summed over every core copying at once.
        handoff_s: one hand-off between two ranks that spin (post, and the waiting peer
            sees it): the hand-off while every rank has a core.
        wake_s: one hand-off to a sleeping peer (post, futex wake, it runs): the hand-off
            when ranks outnumber cores (0: as ``handoff_s``).
        cache_bytes: the last-level cache the ranks share (0: unknown).
    """

    nodes: tuple[tuple[int, ...], ...]
    copy_one_Bps: float
    copy_all_Bps: float
    handoff_s: float
    wake_s: float = 0.0
    cache_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.nodes or not all(self.nodes):
            raise ValueError(f"Machine.nodes {self.nodes!r}: at least one NUMA node, each with a core")
        for name in ("copy_one_Bps", "copy_all_Bps", "handoff_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"Machine.{name} {value!r} must be a finite number > 0")

    @property
    def cores(self) -> list[int]:
        return [c for node in self.nodes for c in node]

    def node_of(self, core: int) -> int:
        return next(i for i, node in enumerate(self.nodes) if core in node)


def rank_groups(L: int, machine: Machine) -> tuple[tuple[int, ...], ...]:
    """The local ranks of each NUMA node, rank ``r`` on the core that ``--bind core``
    gives it (:func:`shmtrain.fabric.shm.affinity.share`); nodes without a rank left out."""
    from shmtrain.fabric.shm.affinity import share

    cores = machine.cores
    groups: dict[int, list[int]] = {}
    for r in range(L):
        groups.setdefault(machine.node_of(share(r, L, cores)[0]), []).append(r)
    return tuple(tuple(groups[k]) for k in sorted(groups))


def block_bytes_for(L: int, groups: int, machine: Machine, itemsize: int = 4) -> int:
    """Bytes per rank and block: the ring (two blocks of ``L`` inputs, results and
    ``groups`` partials) within the shared cache, in ``[MIN_BLOCK, MAX_BLOCK]``, whole pages."""
    cache = machine.cache_bytes or (32 << 20)
    block = cache // (2 * (L + 1 + groups))
    block = max(MIN_BLOCK, min(MAX_BLOCK, block))
    return max(PAGE, block // PAGE * PAGE)


def split(numel: int, parts: int, granule: int = GRANULE) -> list[tuple[int, int]]:
    """``[0, numel)`` in ``parts`` contiguous ranges, boundaries on ``granule`` (the
    compiled path's partition, in C the same arithmetic)."""
    per = -(-numel // parts) if parts else numel
    per = -(-per // granule) * granule
    return [(min(i * per, numel), min((i + 1) * per, numel)) for i in range(parts)]


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank moves in one call. ``shared_*``: through the shared ring (what
    passes between ranks); ``private_*``: its own tensor (every plan reads it once and
    writes it once, plus one more read at ``L = 2`` all-read); ``remote_read``: the
    shared reads of memory another NUMA node's rank wrote."""

    shared_read: int = 0
    shared_written: int = 0
    private_read: int = 0
    private_written: int = 0
    remote_read: int = 0

    @property
    def shared(self) -> int:
        """Shared bytes read + written: the hand-off traffic the choice is about."""
        return self.shared_read + self.shared_written

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(*(a + b for a, b in zip(self._tuple(), other._tuple(), strict=True)))

    def times(self, k: int) -> Traffic:
        return Traffic(*(a * k for a in self._tuple()))

    def _tuple(self) -> tuple[int, ...]:
        return (self.shared_read, self.shared_written, self.private_read, self.private_written, self.remote_read)


@dataclass(frozen=True)
class Plan:
    """One call's algorithm over ``L`` ranks: ``numel`` elements of ``itemsize`` bytes
    through blocks of ``block_bytes``; ``groups``: the ranks of each NUMA node."""

    algorithm: str
    L: int
    numel: int
    itemsize: int
    block_bytes: int
    groups: tuple[tuple[int, ...], ...] = field(default=())
    predicted_s: float = 0.0

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm {self.algorithm!r}: choose one of {', '.join(ALGORITHMS)}")

    @property
    def per(self) -> int:
        """Elements per block."""
        return self.block_bytes // self.itemsize

    @property
    def blocks(self) -> int:
        return -(-self.numel // self.per)

    @property
    def handoffs(self) -> int:
        """Hand-offs of the whole call."""
        return self.blocks * HANDOFFS[self.algorithm]

    def traffic(self, rank: int) -> Traffic:
        """Bytes rank ``rank`` reads and writes in this call, counted block by block
        from the partitions the executor uses."""
        full, last = divmod(self.numel, self.per)
        total = self._block(rank, self.per).times(full)
        return total + self._block(rank, last) if last else total

    def _block(self, r: int, m: int) -> Traffic:
        L, size = self.L, self.itemsize
        group_of = {q: g for g, members in enumerate(self.groups) for q in members} or dict.fromkeys(range(L), 0)
        remote_peers = sum(1 for q in range(L) if group_of[q] != group_of[r])
        if self.algorithm == "all-read":
            rows = L - 1 if L == 2 else L  # at L = 2 the own row is the tensor itself
            return Traffic(rows * m * size, m * size, (2 if L == 2 else 1) * m * size, m * size,
                           remote_peers * m * size)
        pieces = split(m, L)
        lo, hi = pieces[r]
        c = hi - lo
        remote_gather = sum(b - a for q, (a, b) in enumerate(pieces) if group_of[q] != group_of[r])
        if self.algorithm == "split":
            return Traffic(((L - 1) * c + m - c) * size, (m - c + c) * size, m * size, m * size,
                           (remote_peers * c + remote_gather) * size)
        members = self.groups[group_of[r]]
        glo, ghi = split(m, len(members))[members.index(r)]
        gc = ghi - glo
        S = len(self.groups)
        read = (len(members) - 1) * gc + S * c + (m - c)
        written = (m - gc) + gc + c  # copy-in, the group's partial, the result
        return Traffic(read * size, written * size, m * size, m * size, ((S - 1) * c + remote_gather) * size)

    def describe(self) -> str:
        """``split, 512 KiB blocks, 2 hand-offs per block`` (for tables and logs)."""
        return f"{self.algorithm}/{self.block_bytes >> 10}K"


def predict(plan: Plan, machine: Machine) -> float:
    """Seconds the model gives ``plan`` on ``machine`` (the slowest rank's)."""
    L = plan.L
    cores = len(machine.cores)
    rate = min(machine.copy_one_Bps, machine.copy_all_Bps / min(L, cores))
    queue = max(1.0, L / cores)  # ranks beyond the cores wait for one
    worst = 0.0
    for r in range(L):
        t = plan.traffic(r)
        moved = t.shared + t.private_read + t.private_written + (REMOTE_FACTOR - 1) * t.remote_read
        worst = max(worst, moved / rate)
    latency = machine.handoff_s if L <= cores or not machine.wake_s else machine.wake_s
    handoff = latency * max(1.0, math.log2(L))
    return queue * (worst + plan.handoffs * handoff)


def choose(L: int, nbytes: int, itemsize: int, machine: Machine, *, block_bytes: int | None = None,
           algorithm: str | None = None) -> Plan:
    """The plan for ``nbytes`` over ``L`` ranks on ``machine``: the cheapest by
    :func:`predict` of all-read, split and (several NUMA nodes holding ranks) two-level;
    all-read at ``L <= 2``. ``algorithm`` forces one; ``block_bytes`` fixes the block
    (default: :func:`block_bytes_for`)."""
    if L < 1:
        raise ValueError(f"L={L}: at least one rank")
    groups = rank_groups(L, machine)
    if block_bytes is None:
        block_bytes = block_bytes_for(L, len(groups), machine, itemsize)
    block_bytes = max(itemsize, block_bytes // itemsize * itemsize)
    numel = nbytes // itemsize
    if algorithm is not None:
        plan = Plan(algorithm, L, numel, itemsize, block_bytes, groups)
        return _with_prediction(plan, machine)
    names = ["all-read"] if L <= 2 else ["all-read", "split"] + (["two-level"] if len(groups) > 1 else [])
    plans = [_with_prediction(Plan(n, L, numel, itemsize, block_bytes, groups), machine) for n in names]
    return min(plans, key=lambda p: p.predicted_s)


def _with_prediction(plan: Plan, machine: Machine) -> Plan:
    return Plan(plan.algorithm, plan.L, plan.numel, plan.itemsize, plan.block_bytes, plan.groups,
                predict(plan, machine))
