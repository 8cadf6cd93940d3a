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

Staged (GPU parameters): the weights and gradients stay on each worker's GPU and the
star's buffers in host memory. After backward the gradients are copied into ``mine``
(``copy_to_host``); the server copies the mean back into its ``param.grad``, steps its
optimizer on the GPU and copies its weights into ``server`` before the broadcast; every
worker then copies ``server`` into its parameters (``copy_to_device``).

The exchange itself (slots, sequence words, gloo among hosts, or the gloo star) is
:mod:`shmtrain.fabric.exchanges.star`, asked of the transports with ``--ps-transport``; what both
parameter servers share (their configuration, the release of the star, the phase timer
:func:`ps_phase`) is :class:`~shmtrain.strategies.parts.ParameterServer` in ``parts.py``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from shmtrain.strategies.base import register
from shmtrain.strategies.layout.flat import FlatLayout
from shmtrain.strategies.optim.step_journal import JournaledSteps
from shmtrain.strategies.parts import ParameterServer, ParameterServerConfig, ps_phase


@register
class ParameterServerGrad(JournaledSteps, ParameterServer):
    """Gradient-averaging parameter server, rank 0 the server (eq. 2.1, Section 6)."""

    name = "ps_grad"
    synchronous = True
    #: a worker killed on one host is replaced in place: every rank goes on from the state
    #: after the last whole step, which the server journals (``strategies/optim/step_journal.py``)
    recovery = "replica"
    Config = ParameterServerConfig
    fp16_reason = ("only the server steps its optimizer, so the workers' GradScalers would never "
                   "see the gradients they scaled")

    def __init__(self, config, ctx, model, optimizer, timer=None, *, transports=None) -> None:
        super().__init__(config, ctx, model, optimizer, timer, transports=transports)
        self.layout = FlatLayout(self.params)
        # step 1: rank 0's initial weights are every worker's server weights
        self.star = self.transports.star(
            config.ps_transport, "ps_grad", self.layout.numel, self.layout.dtype, self.layout.gather()
        )
        #: the server's weights: every worker's parameters are views of them (shm: one
        #: shared buffer for the host; gloo: a private flat buffer the broadcast fills)
        self.weights = self.star.server
        #: this worker's gradient: its parameters' ``.grad`` are views of it
        self.grad = self.star.mine
        self._grad_views = self.layout.views(self.grad)
        self.staging = None
        if self.staged:  # the parameters stay on their device; copies at each exchange
            self.staging = self.make_staging(self.layout)
            self.staging.register(self.grad, self.weights)
            self._weight_views = self.layout.views(self.weights)
            self._to_device(self._weight_views, data=True)
        else:
            self.layout.bind_data(self.weights, copy=False)
        self.zero_grad()

    def _to_device(self, views: list[torch.Tensor], data: bool) -> None:
        """Staged: host views into the parameters' gradients (or weights), then a stream wait."""
        self.timer.add_copies("copy_to_device", self.staging.to_device_all(views, data=data))

    def _to_host(self, views: list[torch.Tensor], grads: bool) -> None:
        """Staged: the parameters' gradients (or weights) into host views."""
        self.timer.add("copy_to_host", self.staging.to_host_all(views, grads=grads))

    @property
    def is_server(self) -> bool:
        return self.star.is_server

    def journals(self) -> bool:
        """The server journals each step (one host, CPU parameters)."""
        return self.is_server and self.ctx.num_nodes == 1 and self.staging is None

    def zero_grad(self) -> None:
        if self.staging is not None:
            self.optimizer.zero_grad(set_to_none=True)
            return
        self.grad.zero_()
        self.layout.bind_grads(self._grad_views)

    def after_backward(self) -> None:
        """Steps 3-4: the server gathers and averages the gradients (into its own; staged,
        back into its ``param.grad`` too, so the mean is there before the update, as a
        user's clip between backward and step expects)."""
        if self.staging is not None:
            self._to_host(self._grad_views, grads=True)
        self.star.gather_mean(self.grad, phase=partial(ps_phase, self.timer))
        if self.staging is not None and self.is_server:
            self._to_device(self._grad_views, data=False)

    def apply_update(self) -> None:
        """Step 5: only the server applies the averaged gradient to its weights."""
        if self.is_server:
            self.step_optimizer()
            if self.staging is not None:  # the new weights into the server buffer
                self._to_host(self._weight_views, grads=False)
            self.journal_step()  # recovery in place: before the broadcast lets a worker complete it

    def after_update(self) -> None:
        """Step 6: the server's weights reach every worker."""
        with ps_phase(self.timer, "broadcast"):
            self.star.broadcast()
        if self.staging is not None and not self.is_server:
            self._to_device(self._weight_views, data=True)
        super().after_update()

    # state_dict: the iteration only; the weights are the model's, the momentum the
    # server's optimizer's (both saved by their owners).

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the iteration; rank 0's weights become every worker's server weights.

        The parameters are views of the server weights, so loading the model (before this
        call, on every rank) has written them; this makes them rank 0's everywhere (with
        ``shm``: after every local worker has loaded; among hosts: rank 0's broadcast)."""
        super().load_state_dict(state)
        if self.staging is not None:
            self._to_host(self._weight_views, grads=False)
        self.star.set_server(self.weights)
        if self.staging is not None:
            self._to_device(self._weight_views, data=True)

    def finish(self) -> None:
        """Give the model private copies of its weights, so it outlives the shared buffers."""
        self.close_journal()
        self.release_weights()
        for p in self.params:
            p.grad = None
        self._grad_views = []
        self.grad = torch.empty(0)
        super().finish()
