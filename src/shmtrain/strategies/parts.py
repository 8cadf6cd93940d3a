"""The parts several strategies are built from (one home, so a strategy that uses one
imports no other strategy and registers nothing as a side effect).

Gradients in the allreduce's own slots (:class:`SlotGradients`,
:class:`CastSlotGradients`): the part of synchronous SGD that ``ssgd``, ``ssgd
--sharded-update``, ``hsgd``'s groups and ``diloco --inner host-sync`` share.

Zero copy in: before backward, ``param.grad`` are views of this worker's (zeroed) input
slot, so autograd writes the gradients straight into shared memory. Zero copy out: after
the allreduce, ``param.grad`` are re-pointed at the result, which the optimizer reads
in place. Both slot sets alternate by step parity (``shm_allreduce.py``), and the views
of both are made once, so binding is pointer work.

Staged (GPU parameters, ``Strategy.staged``): the gradients stay on the device; each
one's copy into its place in the input slot starts from its gradient hook on the
device-to-host stream while backward goes on (TRL Algorithm 6, line 5, with the slot as
``p_grads``: the slots are page-locked, so the copy is DMA straight into shared
memory); after backward the worker waits for the copies still in flight (``d2h_wait``),
the host allreduce runs, and the mean goes back into ``param.grad`` on the
host-to-device stream, which the optimizer's stream waits for (a stream wait). The
copies' device times are the phases ``copy_to_host`` and ``copy_to_device`` (TRL
Table 4), outside ``comm``.

The parameter server (:class:`ParameterServer`, :class:`ParameterServerConfig`,
:func:`ps_phase`): what ``ps_grad`` (SHM-Learn-Dist eq. 2.1) and ``ps_weight`` (eq. 2.2)
share: the star exchange's options, its release, and the PS-TIMING phases.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from shmtrain.fabric.exchanges.star import TRANSPORTS, StarTransport
from shmtrain.strategies.base import Strategy, StrategyConfig
from shmtrain.strategies.layout.flat import FlatLayout
from shmtrain.strategies.layout.staging import Copy, HostStaging
from shmtrain.timing import PhaseTimer


class SlotGradients:
    """Mixin for a Strategy with ``layout`` (FlatLayout), ``allreduce`` (with ``input``,
    ``result``, ``count`` and a call that reduces) and ``timer``: ``ssgd`` (the whole
    job's allreduce) and ``hsgd`` (its group's, ShmCaffe Fig. 4)."""

    #: the phase the allreduce is timed as (hsgd: ``allreduce``, which it adds to ``comm``
    #: with its broadcast)
    allreduce_phase: ClassVar[str] = "comm"
    layout: FlatLayout
    allreduce: Any
    timer: PhaseTimer
    staged: bool
    staging: HostStaging | None = None

    def bind_slots(self) -> None:
        """Make the views of both slot sets and both results, and zero the first input."""
        self._input_views = [self.layout.views(self.allreduce.input(s)) for s in (0, 1)]
        self._result_views = [self.layout.views(self.allreduce.result(s)) for s in (0, 1)]
        if self.staged:
            self.staging = self.make_staging(self.layout)  # type: ignore[attr-defined]
            self.staging.register(self.allreduce.input(0), self.allreduce.input(1),
                                  self.allreduce.result(0), self.allreduce.result(1))
            self._index = {id(p): i for i, p in enumerate(self.layout.params)}
            self._copies: dict[int, Copy] = {}
            self.register_gradient_hooks(self._stage_gradient)  # type: ignore[attr-defined]
        self.clear_slots()

    def zero_grad(self) -> None:
        self.clear_slots()

    def clear_slots(self) -> None:
        """Zero the next step's input slot and point ``param.grad`` at it (staged: clear
        the device gradients and the copies of the last step)."""
        if self.staged:
            self.optimizer.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
            self._copies.clear()
            return
        step = self.allreduce.count + 1
        self.allreduce.input(step).zero_()
        self.layout.bind_grads(self._input_views[step % 2])

    def _stage_gradient(self, param: torch.Tensor) -> None:
        """Staged only (a gradient hook): start the copy of this gradient into its place in the input slot."""
        i = self._index[id(param)]
        slot = self._input_views[(self.allreduce.count + 1) % 2][i]
        self._copies[i] = self.staging.to_host(i, param.grad, dst=slot)[1]  # type: ignore[union-attr]

    def after_backward(self) -> None:
        if self.staged:
            self._staged_after_backward()
            return
        with self.timer.phase(self.allreduce_phase):
            self.allreduce()
        self.layout.bind_grads(self._result_views[self.allreduce.count % 2])

    def _staged_after_backward(self) -> None:
        staging, timer = self.staging, self.timer
        inputs = self._input_views[(self.allreduce.count + 1) % 2]
        start = time.perf_counter()
        for i, slot in enumerate(inputs):
            if i not in self._copies:  # a parameter backward did not reach
                slot.zero_()
        copy_s = sum(copy.wait() for copy in self._copies.values())
        waited = time.perf_counter() - start
        timer.add("d2h_wait", waited)
        timer.add("copy_to_host", copy_s)
        with timer.phase(self.allreduce_phase):
            self.allreduce()
        # the optimizer's stream waits for the copies back; they are timed when the iteration closes
        timer.add_copies("copy_to_device", staging.to_device_all(self._result_views[self.allreduce.count % 2]))
        timer.add("comm", waited)

    def after_update(self) -> None:
        if self.staged:
            self._copies.clear()
        super().after_update()  # type: ignore[misc]

    def finish(self) -> None:
        if self.staging is not None:
            self.staging.close()
        super().finish()  # type: ignore[misc]


class CastSlotGradients(SlotGradients):
    """The same, through an allreduce of a narrower dtype (``--comm-dtype bf16``):
    ``param.grad`` cannot be views of a bfloat16 slot (autograd writes the
    parameters' dtype), so they are views of one private float32 flat buffer instead (on
    the parameters' device); after backward that buffer is cast into this worker's slot
    in one pass, and the mean is cast back into it in one more. The slots and the bytes
    between hosts are halved (and the device copies with them, staged); the optimizer and
    the weights stay float32."""

    def bind_slots(self) -> None:
        device = self.layout.params[0].device
        self._flat = torch.empty(self.layout.numel, dtype=self.layout.dtype, device=device)
        self._flat_views = self.layout.views(self._flat)
        self.clear_slots()

    def clear_slots(self) -> None:
        self._flat.zero_()
        self.layout.bind_grads(self._flat_views)

    def after_backward(self) -> None:
        with self.timer.phase("comm"):
            slot = self.allreduce.input(self.allreduce.count + 1)
            # on a GPU the cast runs there, so the copy to host moves the narrow bytes; on
            # the CPU the copy casts in its one pass
            slot.copy_(self._flat if self._flat.device.type == "cpu" else self._flat.to(slot.dtype))
            self.allreduce()
            self._flat.copy_(self.allreduce.result(self.allreduce.count))

    def after_update(self) -> None:
        super(SlotGradients, self).after_update()  # type: ignore[misc]


#: the values of ``--ps-transport`` (:func:`shmtrain.fabric.exchanges.star.open_star`)
PS_TRANSPORTS = TRANSPORTS
#: the phases a parameter-server round reports (PS-TIMING, SHM-Learn-Dist Figs. 6.4-6.6)
PS_PHASES = ("gather", "average", "broadcast")


@dataclass(kw_only=True, slots=True)
class ParameterServerConfig(StrategyConfig):
    """Options of both parameter servers (``ps_grad``, ``ps_weight``)."""

    #: how gradients / weights reach the server: "shm" (shared-memory slots inside a host,
    #: gloo gather/broadcast among hosts) or "gloo" (torch.distributed gather/broadcast for
    #: every worker: the Caffe-MPI star of ShmCaffe Section IV-C)
    ps_transport: StarTransport = field(default="shm", metadata={"help": (
        "how the parameter server gathers and broadcasts: shm (shared memory in a host, "
        "gloo among hosts) or gloo (torch.distributed gather/broadcast: the Caffe-MPI star)")})

    def __post_init__(self) -> None:
        if self.ps_transport not in PS_TRANSPORTS:
            raise ValueError(
                f"--ps-transport {self.ps_transport!r} is not a transport; choose "
                f"{' or '.join(PS_TRANSPORTS)} (shm: shared memory inside a host; gloo: "
                "torch.distributed gather/broadcast, the Caffe-MPI baseline)"
            )


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


class ParameterServer(Strategy):
    """What both parameter servers share: the star exchange (``self.star``), the flat
    weights (``self.weights``, bound to ``self.layout``) and its staging."""

    star: Any
    weights: torch.Tensor
    layout: FlatLayout
    staging: Any = None

    def release_weights(self) -> None:
        """Close the staging and the star, giving the model private copies of its weights
        first, so it outlives the shared buffers (staged: the GPU holds them already)."""
        own = self.weights.clone() if self.staging is None else None
        if self.staging is not None:
            self.staging.close()
        self.star.close()
        if own is not None:
            self.layout.bind_data(own, copy=False)
            self.weights = own
