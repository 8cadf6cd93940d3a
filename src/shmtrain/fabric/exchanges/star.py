"""The parameter server's star exchange: gather to rank 0, average, broadcast from rank 0.

Both parameter servers (``ps_grad``, SHM-Learn-Dist eq. 2.1; ``ps_weight``, eq. 2.2) run
the same exchange with rank 0 as the server; only what they put in the buffers differs.
:func:`open_star` builds it for ``--ps-transport``:

* ``shm`` (:class:`ShmStar`): one host segment holds a page-aligned slot per local
  worker (``mine``) and the host's server buffer (``server``), so inside a host nothing
  is copied to move data: the *gather* is every worker's post on the control block
  (:class:`StarRound`) and the leader's sleep until all have posted, the leader averages
  the slots (:func:`average_`), and the *broadcast* is one post that wakes the workers.
  Among hosts (``ctx.num_nodes > 1``) the host leaders ``gather`` their host means to
  rank 0 over gloo (:func:`average_among_hosts`) and rank 0 broadcasts the server
  buffer into every host's (:func:`broadcast_among_hosts`).
* ``gloo`` (:class:`GlooStar`): torch.distributed ``gather`` of every worker's private
  ``mine`` to rank 0 and ``broadcast`` of rank 0's private ``server``: the star topology
  of Caffe-MPI, the baseline of ShmCaffe Section IV-C (SHM-BASELINES).

One round is :meth:`Star.gather_mean` then :meth:`Star.broadcast`, called by every rank
in the same order. The phases (``gather``, ``average``, ``broadcast``: PS-TIMING) are
timed by the caller: ``gather_mean`` enters ``phase(name)`` around each of its parts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Literal, get_args

import torch
import torch.distributed as dist

from shmtrain.fabric.job.context import ProcessContext
from shmtrain.fabric.job.hierarchy import Hierarchy
from shmtrain.fabric.shm.host import HostGroup
from shmtrain.fabric.shm.segment import SharedSegment, align
from shmtrain.fabric.shm.stitch import PAGE

#: the values of ``--ps-transport``
#: the values of ``--ps-transport``
StarTransport = Literal["shm", "gloo"]
TRANSPORTS: tuple[str, ...] = get_args(StarTransport)
#: elements per block of the average: one block of every input stays in cache while summed
AVERAGE_BLOCK = 1 << 16

#: a caller's timer of one phase of the round: ``phase("gather")`` is a context manager
Phase = Callable[[str], AbstractContextManager[object]]

_ACTIVE: set[tuple[int, str]] = set()


def _untimed(name: str) -> AbstractContextManager[object]:  # noqa: ARG001 - Phase's signature
    return nullcontext()


def average_(out: torch.Tensor, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``out = (1/N) * sum(inputs)``, element-wise, block by block; returns ``out``.

    The server's step 4 of SHM-Learn-Dist Section 6 (and the mean of eqs. 2.1 / 2.2).
    ``out`` may be one of ``inputs`` (averaged in place, no temporary buffer).
    """
    if not inputs:
        raise ValueError("average_ needs at least one input")
    numel = out.numel()
    for t in inputs:
        if t.numel() != numel:
            raise ValueError(f"cannot average buffers of {t.numel()} and {numel} elements")
    ptr = out.data_ptr()
    alias = next((i for i, t in enumerate(inputs) if t.data_ptr() == ptr), None)
    first = inputs[alias] if alias is not None else inputs[0]
    rest = [t for i, t in enumerate(inputs) if i != (alias if alias is not None else 0)]
    flat_out = out.view(-1)
    flats = [t.view(-1) for t in rest]
    first_flat = first.view(-1)
    for start in range(0, numel, AVERAGE_BLOCK):
        stop = min(start + AVERAGE_BLOCK, numel)
        block = flat_out[start:stop]
        if alias is None:
            block.copy_(first_flat[start:stop])
        for t in flats:
            block.add_(t[start:stop])
    if len(inputs) > 1:
        out.div_(len(inputs))
    return out


class StarRound:
    """Sequence words of one star exchange on a host: every local rank *arrives*, the host
    leader (local rank 0) *publishes*. Waiting sleeps on the control block's futex words.

    Channels are found by name, so a later exchange with the same ``tag`` in the same
    process (a new strategy instance) reuses them; its sequence numbers continue from the
    value the words hold now, which is the same on every rank because every round is
    joined by every rank. Only one live exchange per tag and host is allowed.
    """

    def __init__(self, host: HostGroup, tag: str) -> None:
        key = (id(host), tag)
        if key in _ACTIVE:
            raise ValueError(
                f"a {tag} exchange is already running in this process; close() the previous "
                "DataParallel (or finish() its strategy) before starting another"
            )
        _ACTIVE.add(key)
        self._key = key
        self.host = host
        self.control = host.control
        self.arrived = host.channel(f"{tag}.arrived")
        self.published = host.channel(f"{tag}.published")
        self.base = self.control.get(self.arrived, host.local_rank)
        self.rounds = 0
        self.tag = tag

    @property
    def target(self) -> int:
        return self.base + self.rounds

    def arrive(self) -> None:
        """Start the next round: this worker's buffer is ready for the server."""
        self.rounds += 1
        self.control.post(self.arrived, self.host.local_rank, self.target)

    def wait_arrivals(self) -> None:
        """Leader: sleep until every local worker has arrived at this round."""
        self.control.wait(
            self.arrived, self.host.ranks, self.target, timeout=self.host.timeout,
            what=f"{self.tag} round {self.rounds} (its buffer for the server)",
        )

    def publish(self) -> None:
        """Leader: the server's result of this round is ready."""
        self.control.post(self.published, self.host.local_rank, self.target)

    def wait_published(self) -> None:
        """Sleep until the host leader has published this round."""
        self.control.wait(
            self.published, [0], self.target, timeout=self.host.timeout,
            what=f"{self.tag} round {self.rounds} (the server's result)",
        )

    def close(self) -> None:
        _ACTIVE.discard(self._key)


def shared_buffers(
    host: HostGroup, tag: str, numel: int, dtype: torch.dtype, server_init: torch.Tensor
) -> tuple[SharedSegment, list[torch.Tensor], torch.Tensor]:
    """One segment: a page-aligned slot per local worker, then the server buffer.

    The creator (local rank 0) fills the server buffer with ``server_init`` before any
    peer can attach (step 1: the server's initial weights).
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    stride = align(max(numel, 1) * itemsize, PAGE)
    slots_count = host.local_world

    def init(segment: SharedSegment) -> None:
        segment.tensor(dtype, slots_count * stride, numel).copy_(server_init)

    segment = host.allocate(tag, stride * (slots_count + 1), init=init)
    slots = [segment.tensor(dtype, r * stride, numel) for r in range(slots_count)]
    server = segment.tensor(dtype, slots_count * stride, numel)
    return segment, slots, server


def broadcast_among_hosts(hierarchy: Hierarchy, tensor: torch.Tensor) -> None:
    """Leaders: copy rank 0's ``tensor`` into every host's (gloo among the leaders)."""
    if hierarchy.group is not None:
        hierarchy.broadcast(tensor, src=0)


def average_among_hosts(hierarchy: Hierarchy, tensor: torch.Tensor, buffers: list[torch.Tensor]) -> None:
    """Leaders: gather every host's ``tensor`` (its host mean) to rank 0, which averages
    them into its own ``tensor``. Hosts have equal worker counts, so the mean of host means
    is the mean over all workers."""
    server = bool(buffers)  # host 0's leader, which holds a buffer per host
    hierarchy.gather(tensor, buffers if server else None)
    if server:
        average_(tensor, buffers)


class Star(ABC):
    """The parameter server's exchange among every worker of ``ctx``'s job, rank 0 the
    server (collective: every rank makes the same calls in the same order).

    Attributes:
        server: the server's flat buffer (weights or accumulator), ``init`` at the start
            on every worker; shared by the workers of a host with ``shm``, private with
            ``gloo``. After :meth:`broadcast` every worker's ``server`` holds rank 0's.
        mine: this worker's flat buffer for the server (its slot with ``shm``, private
            with ``gloo``), zero at the start; :meth:`gather_mean` averages every
            worker's ``mine``.
    """

    server: torch.Tensor
    mine: torch.Tensor

    def __init__(self, ctx: ProcessContext, tag: str) -> None:
        self.ctx = ctx
        self.tag = tag

    @property
    def is_server(self) -> bool:
        """True on rank 0, the parameter server."""
        return self.ctx.rank == 0

    @abstractmethod
    def gather_mean(self, into: torch.Tensor, phase: Phase = _untimed) -> None:
        """Start a round: the server averages every worker's ``mine`` into ``into`` (which
        may be its own ``mine`` or ``server``). Other workers contribute and return; their
        ``into`` is left undefined (with ``shm`` a host leader's holds its host's mean).
        ``phase("gather" | "average")`` is entered around each part of the work."""

    @abstractmethod
    def broadcast(self) -> None:
        """End the round: rank 0's ``server`` reaches every worker's ``server`` (with
        ``shm``, the host's shared one; workers must not write it meanwhile)."""

    def mean_to_all(self, phase: Phase = _untimed) -> None:
        """One weight-averaging round (SHM-Learn-Dist eq. 2.2): every worker's ``mine``
        becomes the mean of all of them. By default the mean goes through ``server``
        (``broadcast`` is timed as "broadcast", with the copy into ``mine``)."""
        self.gather_mean(self.server, phase)
        with phase("broadcast"):
            self.broadcast()
            self.mine.copy_(self.server)

    @abstractmethod
    def set_server(self, values: torch.Tensor) -> None:
        """Make rank 0's ``values`` the ``server`` of every worker (collective, between
        rounds; ``values`` may be ``server`` itself, e.g. when the model's parameters are
        views of it and loading the model filled it)."""

    @abstractmethod
    def close(self) -> None:
        """Release the exchange (a later one with the same tag may start); ``server`` and
        ``mine`` must not be used afterwards."""


class ShmStar(Star):
    """Shared-memory slots in a host, gloo among the host leaders (module docstring)."""

    def __init__(
        self, ctx: ProcessContext, tag: str, numel: int, dtype: torch.dtype, init: torch.Tensor
    ) -> None:
        super().__init__(ctx, tag)
        self.round = StarRound(ctx.host, tag)
        self.hierarchy = Hierarchy(ctx.host, ctx.leaders)
        try:
            self._segment, self.slots, self.server = shared_buffers(ctx.host, tag, numel, dtype, init)
            self._host_means: list[torch.Tensor] = []
            if ctx.num_nodes > 1:
                broadcast_among_hosts(self.hierarchy, self.server)
                ctx.host.barrier(f"{tag} initial weights")
                if ctx.rank == 0:
                    self._host_means = [torch.empty(numel, dtype=dtype) for _ in range(ctx.num_nodes)]
        except BaseException:
            self.round.close()
            raise
        self.mine = self.slots[ctx.local_rank]

    def gather_mean(self, into: torch.Tensor, phase: Phase = _untimed) -> None:
        self.round.arrive()
        if self.ctx.local_rank != 0:
            return
        with phase("gather"):
            self.round.wait_arrivals()
        with phase("average"):
            average_(into, self.slots)
        if self.ctx.num_nodes > 1:
            with phase("gather"):
                average_among_hosts(self.hierarchy, into, self._host_means)

    def broadcast(self) -> None:
        if self.ctx.local_rank == 0:
            broadcast_among_hosts(self.hierarchy, self.server)
            self.round.publish()
        else:
            self.round.wait_published()

    def set_server(self, values: torch.Tensor) -> None:
        host = self.ctx.host
        host.barrier(f"{self.tag} set_server (every worker's values are in)")
        if self.ctx.local_rank == 0:
            if values is not self.server:
                self.server.copy_(values)
            broadcast_among_hosts(self.hierarchy, self.server)
        host.barrier(f"{self.tag} set_server (the server's values)")

    def close(self) -> None:
        self.round.close()
        self.slots = []
        self._host_means = []


class GlooStar(Star):
    """torch.distributed gather / broadcast over the whole job (the Caffe-MPI star)."""

    def __init__(
        self, ctx: ProcessContext, tag: str, numel: int, dtype: torch.dtype, init: torch.Tensor
    ) -> None:
        super().__init__(ctx, tag)
        self.server = torch.empty(numel, dtype=dtype)
        self.server.copy_(init)
        dist.broadcast(self.server, src=0)
        self.mine = torch.zeros(numel, dtype=dtype)
        self._gathered = (
            [torch.empty(numel, dtype=dtype) for _ in range(ctx.world_size)] if ctx.rank == 0 else None
        )

    def gather_mean(self, into: torch.Tensor, phase: Phase = _untimed) -> None:
        with phase("gather"):
            dist.gather(self.mine, gather_list=self._gathered, dst=0)
        if self._gathered is not None:
            with phase("average"):
                average_(into, self._gathered)

    def broadcast(self) -> None:
        dist.broadcast(self.server, src=0)

    def mean_to_all(self, phase: Phase = _untimed) -> None:
        """Over gloo the mean needs no server copy: rank 0 averages the gathered buffers
        into its own ``mine`` and broadcasts that (no extra pass over the weights)."""
        self.gather_mean(self.mine, phase)
        with phase("broadcast"):
            dist.broadcast(self.mine, src=0)

    def set_server(self, values: torch.Tensor) -> None:
        if values is not self.server:
            self.server.copy_(values)
        dist.broadcast(self.server, src=0)

    def close(self) -> None:
        self._gathered = None


def open_star(
    ctx: ProcessContext,
    name: Literal["shm", "gloo"],
    tag: str,
    numel: int,
    dtype: torch.dtype,
    init: torch.Tensor,
) -> Star:
    """The star exchange ``name`` (a value of ``--ps-transport``) of ``numel`` elements of
    ``dtype``, channels and segments named by ``tag``; ``server`` starts as rank 0's
    ``init`` on every worker (step 1 of SHM-Learn-Dist Section 6)."""
    if name == "shm":
        return ShmStar(ctx, tag, numel, dtype, init)
    if name == "gloo":
        return GlooStar(ctx, tag, numel, dtype, init)
    raise ValueError(
        f"--ps-transport {name!r} is not a transport; choose {' or '.join(TRANSPORTS)} "
        "(shm: shared memory inside a host; gloo: torch.distributed gather/broadcast, the "
        "Caffe-MPI baseline)"
    )
