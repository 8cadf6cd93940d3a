"""The transport seam: everything a strategy communicates through, built by one object.

A strategy never builds a transport itself; it is handed a :class:`Transports` (built
from its :class:`ProcessContext` when none is given) and asks it for an allreduce
(``--allreduce``), a bucket reducer (``ssgd --overlap``), the buffer service (SMB-API)
or the parameter-server star exchange; it reaches the host's services through it too
(segments, the control block's words, barriers), never through ``ctx.host``
(``tests/strategies/test_seams.py`` checks both). Tests and other deployments pass their own (a
remote buffer service, an in-process fake): hivemind passes ``p2p`` into its
``AllReduceRunner`` and torchft the process group into its ``Manager`` the same way.

Each factory names the transports it knows and refuses others by name. Every transport
here spans hosts (inside a host through shared memory, between hosts through gloo or a
memory server), so no strategy is held to one host by its transport today; a strategy
whose transport were one host's would say so in ``hosts_reason``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from shmtrain.fabric.job.context import ProcessContext
from shmtrain.fabric.shm.segment import SharedSegment
from shmtrain.fabric.smb import BufferService, LocalBufferService
from shmtrain.fabric.smb.remote import RemoteBufferService, read_secret

if TYPE_CHECKING:
    from shmtrain.fabric.compress.allreduce import CompressedAllreduce
    from shmtrain.fabric.compress.codec import CompressSpec
    from shmtrain.fabric.exchanges.accumulator import SharedAccumulator
    from shmtrain.fabric.exchanges.combiner import HostCombiner
    from shmtrain.fabric.exchanges.tree_window import TreeWindow
    from shmtrain.fabric.job.nccl_group import NcclGroup
    from shmtrain.fabric.job.subgroup import HostSubgroup


class Allreduce(Protocol):
    """What every ``--allreduce`` gives a strategy: two alternating input slots and
    results by step parity, a call that reduces the current input, and a step count."""

    count: int

    def input(self, step: int | None = None) -> torch.Tensor: ...
    def result(self, step: int | None = None) -> torch.Tensor: ...
    def __call__(self) -> torch.Tensor: ...
    def close(self) -> None: ...


class BucketReducer(Protocol):
    """A flat allreduce launched bucket by bucket from gradient hooks (``--overlap``)."""

    def input(self) -> torch.Tensor: ...
    def result(self) -> torch.Tensor: ...
    def launch(self, bucket: int, step: int) -> None: ...
    def progress(self, block: bool = False) -> None: ...
    def reduced(self, bucket: int, step: int) -> bool: ...
    def wait(self, step: int) -> None: ...
    def close(self) -> None: ...


class StarExchange(Protocol):
    """The parameter server's gather of the workers' vectors and broadcast of its own."""

    def is_server(self) -> bool: ...
    def gather_mean(self, into: torch.Tensor, phase=...) -> None: ...
    def broadcast(self) -> None: ...
    def mean_to_all(self, phase=...) -> None: ...
    def set_server(self, values: torch.Tensor) -> None: ...
    def close(self) -> None: ...


class Control(Protocol):
    """Sequence words of a control block (:class:`~shmtrain.fabric.shm.control.ControlBlock`):
    one per channel and rank, written only by its rank, waited on with a futex."""

    def post(self, channel: int, rank: int, value: int) -> None: ...
    def get(self, channel: int, rank: int) -> int: ...
    def wait(self, channel: int, ranks, target: int, *, timeout: float, what: str) -> None: ...
    def check_peers(self, me: int, what: str) -> None: ...


#: the buffer services :func:`open_buffer_service` knows
BUFFER_SERVICES = ("local", "remote")


def open_buffer_service(ctx: ProcessContext, name: str = "local", address: str = "",
                        secret: bytes | None = None, job_server: bool = False) -> BufferService:
    """The buffer service ``name`` for this worker of ``ctx`` (collective: every worker
    opens it, in the same order as its other collectives).

    ``local`` is :class:`LocalBufferService` on the host's shared memory (every worker
    of the host a client); ``remote`` is
    :class:`~shmtrain.fabric.smb.remote.RemoteBufferService` on the memory server at
    ``address`` (every worker of the job a client; ``secret``, else ``SHMTRAIN_SECRET``;
    ``job_server``: the job's own, which keeps no snapshot, so its loss is told apart).
    The name is checked before ``ctx`` is used.
    """
    if name not in BUFFER_SERVICES:
        raise ValueError(f"buffer service {name!r} is unknown; choose one of: {', '.join(BUFFER_SERVICES)}")
    if name == "remote":
        return RemoteBufferService(address, ctx.rank, ctx.world_size, secret=secret or read_secret(None),
                                   timeout=ctx.host.timeout, job_server=job_server)
    return LocalBufferService(ctx.host)


class Transports:
    """Factories for the transports of one worker of ``ctx``'s job (collective calls:
    every rank of the job makes the same calls in the same order)."""

    def __init__(self, ctx: ProcessContext) -> None:
        self.ctx = ctx
        self._job_server = ""  # the address of the memory server this job started, if any

    def allreduce(
        self,
        name: str,
        numel: int,
        dtype: torch.dtype = torch.float32,
        op: Literal["mean", "sum"] = "mean",
        *,
        tag: str = "grads",
    ) -> Allreduce:
        """The allreduce ``name`` (a value of ``--allreduce``) with ShmAllreduce's interface:
        ``input(step)``, ``__call__()``, ``result(step)``, ``count``, ``close()``."""
        from shmtrain.fabric.allreduce.collectives.factory import build_allreduce

        return build_allreduce(name, self.ctx, numel, dtype, op, tag=tag)

    def compressed_allreduce(self, numel: int, spec: CompressSpec, *, tag: str) -> CompressedAllreduce:
        """The mean of a float32 vector over every worker with a compressed hop between
        hosts (``--compress``): dense in each host's shared memory, then each host's
        leader all-gathers its compressed host mean (with error feedback) with the other
        leaders over gloo (:class:`CompressedAllreduce`)."""
        from shmtrain.fabric.compress.allreduce import shm_compressed_allreduce

        return shm_compressed_allreduce(self.ctx.host, self.ctx.leaders, numel, spec, tag=tag)

    def compressed_global(self, service, buffer, spec: CompressSpec):
        """W_g seen through a memory server across a link with ``--compress``: C(dW + e) up,
        a compressed difference against a mirror down (:class:`CompressedGlobal`)."""
        from shmtrain.fabric.smb.compressed import CompressedGlobal

        return CompressedGlobal(service, buffer, spec)

    def group_allreduce(
        self,
        group,
        numel: int,
        dtype: torch.dtype = torch.float32,
        op: Literal["mean", "sum"] = "mean",
        *,
        tag: str = "group",
    ) -> Allreduce:
        """The shared-memory allreduce among a group of one host's workers (``group``: a
        :class:`HostGroup` or a sub-group with its interface, e.g. HSGD's groups)."""
        from shmtrain.fabric.allreduce.shared import ShmAllreduce

        return ShmAllreduce(group, numel, dtype=dtype, op=op, tag=tag)

    def host_allreduce(
        self,
        numel: int,
        dtype: torch.dtype = torch.float32,
        op: Literal["mean", "sum"] = "mean",
        *,
        tag: str = "host",
    ) -> Allreduce:
        """The shared-memory allreduce among this host's workers only (no other host's:
        ``diloco --inner host-sync``'s inner steps)."""
        return self.group_allreduce(self.ctx.host, numel, dtype, op, tag=tag)

    def bucket_reducer(
        self,
        name: Literal["shm", "gloo"],
        numel: int,
        buckets: Sequence[tuple[int, int]],
        dtype: torch.dtype = torch.float32,
        op: Literal["mean", "sum"] = "mean",
        *,
        tag: str = "buckets",
    ) -> BucketReducer:
        """A bucketed allreduce started from gradient hooks: ``shm`` (shared memory in a
        host, gloo between hosts) or ``gloo`` (DDP's transport), one interface."""
        from shmtrain.fabric.allreduce.buckets import BucketAllreduce, GlooBucketAllreduce

        if name == "shm":
            return BucketAllreduce(self.ctx.host, numel, buckets, dtype=dtype, op=op,
                                   leaders=self.ctx.leaders, tag=tag)
        if name == "gloo":
            return GlooBucketAllreduce(numel, buckets, dtype=dtype, op=op)
        raise ValueError(f"--allreduce {name!r} with --overlap: overlapped buckets go through "
                         "shared memory or gloo only; use --allreduce shm or gloo, or drop --overlap")

    def buffer_service(self, name: str = "local", address: str = "", secret: bytes | None = None) -> BufferService:
        """The shared buffer service (SMB-API) of this job: ``local`` is the host's shared
        memory (every worker of the host a client), ``remote`` the memory server at
        ``address`` (every worker of the job a client; ``secret``, or ``SHMTRAIN_SECRET``)."""
        return open_buffer_service(self.ctx, name, address, secret,
                                   job_server=bool(address) and address == self._job_server)

    def memory_server(self) -> tuple[str, bytes]:
        """Start this job's memory server next to global rank 0 (collective); its
        ``HOST:PORT`` and the secret the clients prove."""
        from shmtrain.fabric.smb.job_server import start_memory_server

        address, secret = start_memory_server(self.ctx.store, self.ctx.rank, self.ctx.world_size,
                                              timeout=self.ctx.timeout, rejoined=getattr(self.ctx, "rejoined", False))
        self._job_server = address
        return address, secret

    def host_combiner(self, order: Sequence[int], tensor, done, *, ready=None,
                      name: str = "combiner") -> HostCombiner | None:
        """The cross-host edge of a per-layer reduction (:class:`HostCombiner`): on each
        host's leader, a thread that sums ``tensor(layer, round)`` with the other hosts'
        leaders in ``order`` on a gloo group of its own; None on the other ranks and on
        one host (collective: every rank of the job calls it)."""
        from shmtrain.fabric.exchanges.combiner import HostCombiner
        from shmtrain.fabric.job import hosts
        from shmtrain.fabric.job.hierarchy import Hierarchy

        ctx = self.ctx
        if ctx.num_nodes <= 1:
            return None
        group = hosts.form_leaders(ctx.local_world, ctx.world_size, ctx.timeout)  # a group of its own
        if not ctx.is_leader:
            return None
        return HostCombiner(Hierarchy(ctx.host, group), order, tensor, done, ready=ready, name=f"shmtrain-{name}")

    def star(self, name: Literal["shm", "gloo"], tag: str, numel: int, dtype: torch.dtype,
             init: torch.Tensor) -> StarExchange:
        """The parameter server's gather / broadcast exchange (rank 0 the server)."""
        from shmtrain.fabric.exchanges.star import open_star

        return open_star(self.ctx, name, tag, numel, dtype, init)

    # -- host memory and words of the host's control block -----------------------------
    def segment(self, tag: str, nbytes: int, init: Callable[[SharedSegment], None] | None = None, *,
                group: HostSubgroup | None = None) -> SharedSegment:
        """A shared segment of this host, ``nbytes`` rounded up to whole pages, mapped by
        every local rank (collective on the host; ``init`` runs once, on its creator); with
        ``group`` (a :meth:`subgroup`), one segment per group of the host, this worker's
        group's returned (still collective on the whole host)."""
        from shmtrain.fabric.shm.segment import align
        from shmtrain.fabric.shm.stitch import PAGE

        return (group or self.ctx.host).allocate(tag, align(nbytes, PAGE), init)

    def channel(self, name: str) -> int:
        """A sequence word per local rank in the host's control block (``post``/``wait``
        through :meth:`control`)."""
        return self.ctx.host.channel(name)

    def control(self, group: HostSubgroup | None = None) -> Control:
        """The words of the host's control block: ``post(channel, rank, value)``,
        ``get(channel, rank)``, ``wait(channel, ranks, target, timeout=, what=)`` by local
        rank, and ``check_peers(me, what)`` (raises if a peer died or the host aborted);
        with ``group`` (a :meth:`subgroup`), the same words by rank in the group."""
        return group.control if group is not None else self.ctx.host.control

    def barrier(self, what: str) -> None:
        """Sleep until every worker of this host has reached this barrier (``what`` names
        it in a timeout's message)."""
        self.ctx.host.barrier(what)

    def subgroup(self, group_size: int) -> HostSubgroup:
        """This worker's group of ``group_size`` consecutive local ranks, with a host's
        interface (HSGD's groups, ShmCaffe Fig. 4)."""
        from shmtrain.fabric.job.subgroup import HostSubgroup

        host = self.ctx.host
        return HostSubgroup(host, host.local_world // group_size, group_size)

    def accumulator(self, numel: int, dtype: torch.dtype, layers: int, *, tag: str = "cpu_acc") -> SharedAccumulator:
        """The host's two alternating gradient sums with a critical counter per layer
        (TRL Algorithm 5's ``g_grads`` and ``Critical``, :class:`SharedAccumulator`)."""
        from shmtrain.fabric.exchanges.accumulator import SharedAccumulator

        return SharedAccumulator(self.ctx.host, numel, dtype, layers, tag=tag)

    def tree_window(self, layer_bytes: int, layers: int, *, across_hosts: bool, tag: str = "gpi") -> TreeWindow:
        """CaffeGPI's one-sided window over the host's reduction tree (:class:`TreeWindow`)."""
        from shmtrain.fabric.exchanges.tree_window import TreeWindow

        return TreeWindow(self.ctx.host, layer_bytes, layers, across_hosts=across_hosts, tag=tag)

    def nccl_group(self, device: torch.device) -> NcclGroup:
        """NCCL among every worker of the job, one GPU each (:class:`NcclGroup`; collective)."""
        from shmtrain.fabric.job.nccl_group import NcclGroup

        return NcclGroup(device, self.ctx.world_size)
