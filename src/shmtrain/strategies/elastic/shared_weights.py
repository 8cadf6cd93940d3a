"""What the asynchronous strategies share: global weights on the buffer service, options,
progress publishing and termination alignment (ShmCaffe Sections III-C, III-E, III-F).

Set-up follows Fig. 2 and Fig. 5: the master worker (rank 0) creates the global weight
buffer ``global_weights`` (W_g) on the buffer service and initialises it with its
weights; every worker that updates W_g creates its own ``weight_increment.<rank>``
buffer (dW_x), which only it writes; the others look the global key up and attach.
Each worker's local weights (W_x) live in one private flat tensor with per-layer views,
on the parameters' device: on a GPU the model stays there, and the buffer service's
reads and writes copy between it and the host buffers (W_g, dW_x stay in host memory).

A worker of a host that was lost and started again (``ctx.rejoined``)
finds its buffers by name instead of creating them, takes W_g as its weights and its
iterations from the board (its TERM counter), and trains on from there; the others
never stop (torchft recovers a replica from a live peer; here the peer is the server).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from shmtrain.fabric.compress.codec import parse_compress
from shmtrain.fabric.exchanges.weights import broadcast_parameters
from shmtrain.fabric.smb import STATE_DONE, STATE_TRAINING, Buffer, BufferService
from shmtrain.strategies.base import Strategy, StrategyConfig
from shmtrain.strategies.elastic.compress import load_compress, open_compressed
from shmtrain.strategies.elastic.termination import MASTER, Policy, Termination, check_terminate
from shmtrain.strategies.layout.flat import FlatLayout

GLOBAL_WEIGHTS = "global_weights"


def check_moving_rate(value: float) -> None:
    if not (isinstance(value, int | float) and 0.0 < value <= 1.0):
        raise ValueError(
            f"--moving-rate {value!r} must lie in (0, 1]: it is the elastic averaging rate "
            "alpha of ShmCaffe eqs. (3)-(7) (the paper uses 0.2); pass e.g. --moving-rate 0.2"
        )


def check_update_interval(value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"--update-interval {value!r} must be an integer >= 1: the global weights are "
            "exchanged every update_interval iterations; pass e.g. --update-interval 1"
        )


def check_smb_server(address: str) -> None:
    """``--smb-server`` is empty or ``HOST:PORT``."""
    host, _, port = address.rpartition(":")
    if address and (not host or not port.isdigit() or not 0 < int(port) < 65536):
        raise ValueError(f"--smb-server {address!r} must be HOST:PORT of a `shmtrain smb-server`, "
                         "e.g. 127.0.0.1:29600")


@dataclass(kw_only=True, slots=True)
class AsyncConfig(StrategyConfig):
    """Options of every asynchronous strategy on the buffer service."""

    #: exchange with the global weights every this many iterations (tau, >= 1)
    update_interval: int = field(
        default=1, metadata={"help": "exchange with the global weights every N iterations (tau)"}
    )
    #: termination alignment: master, first or average (ShmCaffe Section III-E)
    terminate: Policy = field(
        default="average",
        metadata={"help": "when asynchronous workers stop: master, first or average (ShmCaffe III-E)"},
    )

    #: HOST:PORT of a ``shmtrain smb-server`` (SMB-REMOTE); empty: this host's shared memory
    smb_server: str = field(
        default="",
        metadata={"help": "HOST:PORT of a `shmtrain smb-server` holding the global weights (SMB-REMOTE; "
                          "lets the job span hosts); default: this host's shared memory"},
    )

    #: across hosts: the share of the target a worker may lead another host's mean (0: no limit)
    host_lead: float = field(
        default=0.0,
        metadata={"help": "across hosts: a worker more than this share of the target ahead of a host's mean "
                          "waits for it (keeps the hosts' exchanges at one pace; 0: never waits, fully "
                          "asynchronous)", "default_text": "0; across hosts 0.05 (docs/choosing_a_method.md)"},
    )

    def __post_init__(self) -> None:
        check_update_interval(self.update_interval)
        if not isinstance(self.host_lead, int | float) or not 0 <= self.host_lead <= 1:
            raise ValueError(f"--host-lead {self.host_lead!r} must lie in [0, 1]: the share of the target a worker "
                             "may lead another host (0: never waits); pass e.g. --host-lead 0.05")
        check_terminate(self.terminate)
        check_smb_server(self.smb_server)


@dataclass(kw_only=True, slots=True)
class ElasticConfig(AsyncConfig):
    """Options of the elastic-averaging strategies (EASGD, SEASGD, HSGD)."""

    #: moving averaging rate alpha in (0, 1] of eqs. (3)-(7)
    moving_rate: float = field(
        default=0.2, metadata={"help": "elastic averaging rate alpha in (0, 1] (ShmCaffe eqs. (3)-(7))",
                               "default_text": "0.2; seasgd and hsgd across hosts 0.5 (docs/choosing_a_method.md)"}
    )

    #: the compressed exchange of a worker whose memory server is on another host
    compress: str = field(default="", metadata={
        "help": "between hosts: exchange compressed differences with the memory server, topk:F,bits:B "
                "(the kept share F of every chunk of 4096, B-bit values; error feedback on the increment, "
                "a mirror of W_g per client; docs/async.md); none: whole weights",
        "default_text": "seasgd and hsgd across hosts topk:0.1,bits:4, else whole weights"})

    def __post_init__(self) -> None:
        AsyncConfig.__post_init__(self)
        check_moving_rate(self.moving_rate)
        parse_compress(self.compress)


def open_global_weights(
    service: BufferService, weights: torch.Tensor, *, increment: bool, rejoin: bool = False
) -> tuple[Buffer, Buffer | None]:
    """Collective set-up of Fig. 2 / Fig. 5: W_g (created by the master) and dW_x.

    Returns the global weights and, if ``increment``, this worker's increment buffer.
    ``rejoin``: this worker's host was lost and started again; its buffers exist (it
    looks them up) and the others are long past the set-up (no collective wait).
    """
    numel = weights.numel()
    global_weights = None
    if service.rank == MASTER:
        global_weights = service.attach(service.create(GLOBAL_WEIGHTS, numel, weights.dtype))
        service.write(global_weights, weights)
    weight_increment = None
    if increment:
        name = f"weight_increment.{service.rank}"
        key = service.lookup(name) if rejoin else service.create(name, numel, weights.dtype)
        weight_increment = service.attach(key)
    if global_weights is None:
        key = service.lookup(GLOBAL_WEIGHTS)
        if key.numel != numel:
            raise ValueError(
                f"the master's model has {key.numel} parameters, this worker's {numel}: every "
                "worker must build the same model"
            )
        global_weights = service.attach(key)
    if not rejoin:
        service.ready()
    return global_weights, weight_increment


class SharedWeightsStrategy(Strategy):
    """Base of the strategies that share weights through the buffer service.

    Subclasses set ``self.termination`` voters if needed and implement the exchange.
    A peer killed during training does not stop the others (``tolerates_peer_loss``).
    """

    #: the launcher records a worker's death without ending the survivors
    tolerates_peer_loss: ClassVar[bool] = True
    tolerates_host_loss: ClassVar[bool] = True
    rejoins: ClassVar[bool] = True
    #: a worker killed on one host is replaced in place from W_g (``runtime/run/recovery.py``)
    recovery: ClassVar[str] = "elastic"

    #: whether this worker writes increments into the global weights
    updates_global: bool = True

    def __init__(self, config, ctx, model, optimizer, timer=None, *, transports=None) -> None:
        super().__init__(config, ctx, model, optimizer, timer, transports=transports)
        self.layout = FlatLayout(self.params)
        broadcast_parameters(self.layout)
        self.weights = self.local_weights_storage()
        self.layout.bind_data(self.weights)
        address, secret = getattr(config, "smb_server", ""), None
        if not address and getattr(ctx, "num_nodes", 1) > 1:  # SMB-REMOTE, started for this job
            address, secret = self.transports.memory_server()
        self.service = self.transports.buffer_service("remote" if address else "local", address, secret)
        rejoined = getattr(ctx, "rejoined", False)
        self.global_weights, self.weight_increment = open_global_weights(
            self.service, self.weights, increment=self.updates_global, rejoin=rejoined
        )
        #: ``--compress`` across the link (None: whole weights, as on the server's host)
        self.compressed = open_compressed(config, ctx, self.transports, self.service, self.global_weights,
                                          self.weight_increment)
        local = getattr(ctx, "local_world", 0) or ctx.world_size
        hosts = [r // local for r in range(ctx.world_size)] if getattr(ctx, "num_nodes", 1) > 1 else None
        self.termination = Termination(config.terminate, self.service.board, hosts=hosts,
                                       lead=getattr(config, "host_lead", 0.0), timeout=ctx.timeout)
        if rejoined:
            self.rejoin()
        self.service.board.set_progress(self.iteration, STATE_TRAINING)
        self._started = -1  # the iteration whose start-of-iteration exchange has run

    def rejoin(self) -> None:
        """This worker's host was lost and started again: go on from the job's state, not
        from disk: the global weights W_g as this worker's weights (its
        first iteration starts from them) and its iterations from the board (the TERM
        counter it published before the loss; the loop's data position follows)."""
        self.service.read(self.global_weights, self.weights)
        self.iteration = self.service.board.progress(self.rejoin_rank())
        print(f"shmtrain: worker rank {self.ctx.rank} rejoined the running job at iteration {self.iteration} "
              "(the global weights and its iteration count from the memory server)", file=sys.stderr, flush=True)

    def rejoin_rank(self) -> int:
        """Whose published iterations a rejoining worker goes on from (its own)."""
        return self.service.rank

    def zero_grad(self) -> None:
        """Clear the gradients, then run the start-of-iteration exchange once per iteration.

        The exchange (Fig. 6, T1-T3) runs here rather than in ``before_forward`` because
        loops time the forward call as ``forward``, which would count it as computation.
        """
        self.clear_gradients()
        if self._started != self.iteration:
            self._started = self.iteration
            self.start_iteration()

    def clear_gradients(self) -> None:
        Strategy.zero_grad(self)

    def start_iteration(self) -> None:
        """Communication at the start of an iteration (none by default)."""

    def local_weights_storage(self) -> torch.Tensor:
        """Where the local weights W_x live (a private flat tensor on the parameters'
        device by default)."""
        return torch.empty(self.layout.numel, dtype=self.layout.dtype, device=self.device)

    def after_update(self) -> None:
        super().after_update()
        self.termination.publish(self.iteration)

    def should_stop(self) -> bool:
        """The termination policy (Section III-E) on the control block's progress words."""
        return self.termination.decide(self.iteration, self.target_iterations)

    def close_exchange(self) -> None:
        """Finish any communication still in flight (before the service closes)."""

    def finish(self) -> None:
        try:
            try:
                self.termination.mark_done(self.iteration)
                board = self.service.board  # who was lost, and where, before the service closes
                self.lost_peers = {r: board.progress(r) for r in range(board.world) if not board.alive(r)}
            finally:
                self.close_exchange()  # the update thread is joined even when the server is gone
            if self.service.rank == MASTER:  # the job's model: W_g as this worker ends
                self.final_global_weights = self._read_global_weights()
        finally:
            self.service.close()
            super().finish()

    def lost_now(self) -> set[int]:
        """The workers the buffer service's board holds for lost now (their ranks): gone
        without having finished (a finished one's process may end before the others')."""
        board = self.service.board
        return {r for r in range(board.world)
                if r != self.service.rank and not board.alive(r) and board.state(r) != STATE_DONE}

    def global_weights_copy(self) -> torch.Tensor:
        """A copy of W_g as it stands, on any worker (every worker has it attached)."""
        return self.service.read(self.global_weights, torch.empty(self.layout.numel, dtype=self.layout.dtype))

    def take_global_weights(self, iteration: int) -> None:
        """A worker that replaces a dead one in place: W_g as its weights and ``iteration``
        as its count (the dead worker's, published on the board), as a host that rejoins
        takes them (:meth:`rejoin`)."""
        self.service.read(self.global_weights, self.weights)
        self.iteration = iteration
        self.termination.publish(iteration)

    def global_weights_now(self) -> torch.Tensor | None:
        """W_g now, on the master (rank 0's evaluation of the job's model); None elsewhere."""
        if self.service.rank != MASTER:
            return None
        return self.service.read(self.global_weights, torch.empty(self.layout.numel, dtype=self.layout.dtype))

    def _read_global_weights(self) -> torch.Tensor | None:
        """W_g for the run's ``model.pt``; None, with a warning, when the buffer service is
        gone (a lost memory server ends no run that tolerates it: rank 0's weights are saved)."""
        try:
            return self.service.read(self.global_weights, torch.empty(self.layout.numel, dtype=self.layout.dtype))
        except Exception as exc:  # noqa: BLE001 - the server's own error, named below
            print(f"shmtrain: warning: the global weights could not be read at the end ({exc}); "
                  "model.pt holds rank 0's own weights", file=sys.stderr)
            return None

    # -- state (checkpoints) ------------------------------------------------------
    def quiesce(self) -> None:
        """Finish the exchange in flight (SEASGD's update thread), so W_g is settled."""
        self.drain_exchange()

    def drain_exchange(self) -> None:
        """Wait for communication in flight to land (none by default)."""

    def state_dict(self) -> dict:
        """The iteration and, on the master (which created it), the global weights W_g;
        each worker's local weights W_x are the model's weights."""
        state = super().state_dict()
        if self.service.rank == MASTER:
            state["global_weights"] = self.service.read(
                self.global_weights, torch.empty(self.layout.numel, dtype=self.layout.dtype)
            )
        if getattr(self.config, "compress", ""):  # the spec, and the error feedback across the link
            state["compress"] = {"spec": parse_compress(self.config.compress).text(),
                                 **(self.compressed.state_dict() if self.compressed is not None else {})}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Collective: the master writes W_g back, then every worker may read it."""
        super().load_state_dict(state)
        load_compress(getattr(self.config, "compress", ""), self.compressed, state.get("compress"))
        if self.service.rank == MASTER:
            self.service.write(self.global_weights, state["global_weights"])
        self.transports.barrier("global weights restored")
