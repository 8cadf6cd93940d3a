"""Parameter server with gradient averaging (GRAD-AVG): SHM-Learn-Dist eq. 2.1, Section 6.

``w = w - eta * (1/N_w) * sum_i g_i`` with rank 0 as the parameter server, in the seven
steps of SHM-Learn-Dist Section 6:

1. rank 0 initialises the weights and distributes them;
2. every worker computes the gradient of its own mini-batch;
3. rank 0 gathers the gradients; 4. averages them; 5. applies them to its weights
   (its optimizer, so momentum and weight decay live on the server only);
6. rank 0 broadcasts the weights; 7. back to 2.

With ``ps_transport="gloo"`` steps 3 and 6 are torch.distributed ``gather`` and
``broadcast`` over every worker: the star topology of Caffe-MPI, the baseline of the
ShmCaffe paper (Section IV-C, SHM-BASELINES). With ``ps_transport="shm"`` (default),
inside a host the exchange is zero-copy shared memory:

* each local worker's ``param.grad`` are views into its own slot of one host segment,
  so backward writes the gradient where the server reads it (gather = a futex post);
* the server averages the slots in place into its own slot (``average_``);
* every local worker's ``param.data`` are views of one shared weights buffer that the
  server's optimizer updates in place, so the broadcast is a futex post too.

Among hosts (``ctx.num_nodes > 1``) each host leader first averages its host's slots,
the leaders ``gather`` those host means to rank 0 over gloo, and rank 0 ``broadcast``s
the new weights into every host's shared weights buffer (PS-TIMING phases ``gather``,
``average``, ``broadcast``, and their total ``comm``).

The pieces both parameter servers share live here: :func:`average_` (the server's
arithmetic, also used by the single-process simulation of the NEURON experiment) and
:class:`StarRound` (arrive / publish sequence words on the host's control block).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shmtrain.fabric.context import ProcessContext
from shmtrain.fabric.flat import FlatLayout
from shmtrain.fabric.host import HostGroup
from shmtrain.fabric.segment import SharedSegment, align
from shmtrain.fabric.stitch import PAGE
from shmtrain.strategies.base import Strategy, StrategyConfig, register
from shmtrain.timing import PhaseTimer

PS_TRANSPORTS = ("shm", "gloo")
#: elements per block of the average: one block of every input stays in cache while summed
AVERAGE_BLOCK = 1 << 16
#: the phases a parameter-server round reports (PS-TIMING, SHM-Learn-Dist Figs. 6.4-6.6)
PS_PHASES = ("gather", "average", "broadcast")

_ACTIVE: set[tuple[int, str]] = set()


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


@dataclass(kw_only=True, slots=True)
class ParameterServerConfig(StrategyConfig):
    """Options of both parameter servers (``ps_grad``, ``ps_weight``)."""

    #: how gradients / weights reach the server: "shm" (shared-memory slots inside a host,
    #: gloo gather/broadcast among hosts) or "gloo" (torch.distributed gather/broadcast for
    #: every worker: the Caffe-MPI star of ShmCaffe Section IV-C)
    ps_transport: str = field(default="shm", metadata={"help": (
        "how the parameter server gathers and broadcasts: shm (shared memory in a host, "
        "gloo among hosts) or gloo (torch.distributed gather/broadcast: the Caffe-MPI star)")})

    def __post_init__(self) -> None:
        if self.ps_transport not in PS_TRANSPORTS:
            raise ValueError(
                f"--ps-transport {self.ps_transport!r} is not a transport; choose "
                f"{' or '.join(PS_TRANSPORTS)} (shm: shared memory inside a host; gloo: "
                "torch.distributed gather/broadcast, the Caffe-MPI baseline)"
            )


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


@contextmanager
def ps_phase(timer: PhaseTimer, name: str) -> Iterator[None]:
    """Time one PS-TIMING phase (``gather``, ``average``, ``broadcast``) and add it to
    ``comm``, the total of the parameter exchange."""
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds = time.perf_counter() - start
        timer.add(name, seconds)
        timer.add("comm", seconds)


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


def require_cpu(name: str, params: Sequence[torch.Tensor]) -> None:
    """The server's buffers live in host memory (shared segments or gloo buffers)."""
    devices = sorted({p.device.type for p in params} - {"cpu"})
    if devices:
        raise ValueError(
            f"--strategy {name} keeps the weights in host (shared) memory, but the model has "
            f"parameters on {', '.join(devices)}; move the model to the CPU or use --strategy ssgd"
        )


def broadcast_among_hosts(ctx: ProcessContext, tensor: torch.Tensor) -> None:
    """Leaders: copy rank 0's ``tensor`` into every host's (gloo over ``ctx.leaders``)."""
    if ctx.leaders is not None and ctx.local_rank == 0:
        dist.broadcast(tensor, src=0, group=ctx.leaders)


def average_among_hosts(ctx: ProcessContext, tensor: torch.Tensor, buffers: list[torch.Tensor]) -> None:
    """Leaders: gather every host's ``tensor`` (its host mean) to rank 0, which averages
    them into its own ``tensor``. Hosts have equal worker counts, so the mean of host means
    is the mean over all workers."""
    if ctx.rank == 0:
        dist.gather(tensor, gather_list=buffers, dst=0, group=ctx.leaders)
        average_(tensor, buffers)
    else:
        dist.gather(tensor, dst=0, group=ctx.leaders)


@register
class ParameterServerGrad(Strategy):
    """Gradient-averaging parameter server, rank 0 the server (eq. 2.1, Section 6)."""

    name = "ps_grad"
    Config = ParameterServerConfig

    def __init__(self, config, ctx, model, optimizer, timer=None) -> None:
        super().__init__(config, ctx, model, optimizer, timer)
        require_cpu(self.name, self.params)
        self.layout = FlatLayout(self.params)
        numel, dtype = self.layout.numel, self.layout.dtype
        if config.ps_transport == "shm":
            self._round = StarRound(ctx.host, "ps_grad")
            self._segment, self.slots, self.weights = shared_buffers(
                ctx.host, "ps_grad", numel, dtype, self.layout.gather()
            )
            if ctx.num_nodes > 1:
                broadcast_among_hosts(ctx, self.weights)
                ctx.host.barrier("ps_grad initial weights")
                self._host_means = [torch.empty(numel, dtype=dtype) for _ in range(ctx.num_nodes)] if ctx.rank == 0 else []
            self.grad = self.slots[ctx.local_rank]
        else:
            self._round = None
            self.weights = torch.empty(numel, dtype=dtype)
            self.layout.gather(out=self.weights)
            dist.broadcast(self.weights, src=0)  # step 1
            self.grad = torch.zeros(numel, dtype=dtype)
            self._gathered = [torch.empty(numel, dtype=dtype) for _ in range(ctx.world_size)] if ctx.rank == 0 else None
        # Every worker's parameters are views of the server's weights (shm: one shared
        # buffer for the host; gloo: a private flat buffer the broadcast fills).
        self.layout.bind_data(self.weights, copy=False)
        self._grad_views = self.layout.views(self.grad)
        self.zero_grad()

    @property
    def is_server(self) -> bool:
        return self.ctx.rank == 0

    def zero_grad(self) -> None:
        self.grad.zero_()
        self.layout.bind_grads(self._grad_views)

    def after_backward(self) -> None:
        """Steps 3-4: the server gathers and averages the gradients."""
        if self._round is None:
            with ps_phase(self.timer, "gather"):
                dist.gather(self.grad, gather_list=self._gathered, dst=0)
            if self.is_server:
                with ps_phase(self.timer, "average"):
                    average_(self.grad, self._gathered)
            return
        self._round.arrive()
        if self.ctx.local_rank != 0:
            return
        with ps_phase(self.timer, "gather"):
            self._round.wait_arrivals()
        with ps_phase(self.timer, "average"):
            average_(self.grad, self.slots)
        if self.ctx.num_nodes > 1:
            with ps_phase(self.timer, "gather"):
                average_among_hosts(self.ctx, self.grad, self._host_means)

    def apply_update(self) -> None:
        """Step 5: only the server applies the averaged gradient to its weights."""
        if self.is_server:
            self.optimizer.step()

    def after_update(self) -> None:
        """Step 6: the server's weights reach every worker."""
        with ps_phase(self.timer, "broadcast"):
            if self._round is None:
                dist.broadcast(self.weights, src=0)
            else:
                if self.ctx.local_rank == 0:
                    broadcast_among_hosts(self.ctx, self.weights)
                    self._round.publish()
                else:
                    self._round.wait_published()
        super().after_update()

    def finish(self) -> None:
        """Give the model private copies of its weights, so it outlives the shared buffers."""
        if self._round is not None:
            self._round.close()
        own = self.weights.clone()
        self.layout.bind_data(own, copy=False)
        for p in self.params:
            p.grad = None
        self.slots = []
        self._grad_views = []
        self.grad = torch.empty(0)
        self.weights = own
        super().finish()
