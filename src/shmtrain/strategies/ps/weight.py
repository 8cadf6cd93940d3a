"""Parameter server with weight averaging (WEIGHT-AVG): SHM-Learn-Dist eq. 2.2.

``w = (1/N_w) * sum_i (w_i - eta * g_i)``: every worker applies its own gradient with
its own optimizer (``w_i - eta * g_i``), then the server (rank 0) averages the workers'
weights element-wise and sends the mean back, every ``average_interval`` iterations.
``average_interval = 1`` is the paper's scheme; a larger interval is local SGD (the
workers drift apart for K steps between averages).

Every worker starts from rank 0's initial weights. With plain SGD, interval 1 and equal
starting weights, eq. 2.2 equals eq. 2.1 (eq. 2.3 with all ``w_i = w``); the two differ
with optimizer state (each worker keeps its own momentum here) or a longer interval.
After the last iteration, if it did not end on an averaging round, ``finish()`` runs one
more round so every worker ends with the same (averaged) weights.

Transports as for :mod:`shmtrain.strategies.ps.grad` (the exchange is
:mod:`shmtrain.fabric.exchanges.star`): each worker's ``param.data`` are views of its own buffer for
the server (``mine``: with ``ps_transport="shm"`` its slot of one host segment); the
server averages them into its ``server`` buffer, which reaches every worker and which every
worker copies into its own (``broadcast``). With ``shm`` the host leader averages the
slots into the host's shared server buffer and, among hosts, the leaders gather their host
means to rank 0, which broadcasts the mean back over gloo; with ``gloo`` it is
torch.distributed ``gather`` / ``broadcast`` of every worker's flat weights.

Staged (GPU parameters): the weights stay on the GPU; an averaging round copies them into
``mine`` first (``copy_to_host``) and the mean back afterwards (``copy_to_device``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

from shmtrain.strategies.base import Strategy, register
from shmtrain.strategies.layout.flat import FlatLayout
from shmtrain.strategies.parts import ParameterServer, ParameterServerConfig, ps_phase


@register
class ParameterServerWeight(ParameterServer):
    """Weight-averaging parameter server, rank 0 the server (eq. 2.2)."""

    name = "ps_weight"

    @dataclass(kw_only=True, slots=True)
    class Config(ParameterServerConfig):
        #: iterations between weight averages: 1 = SHM-Learn-Dist eq. 2.2 every step,
        #: K > 1 = local SGD (each worker takes K own steps, then the weights are averaged)
        average_interval: int = field(default=1, metadata={"help": (
            "iterations between weight averages: 1 = every step (SHM-Learn-Dist eq. 2.2), "
            "K > 1 = local SGD")})

        def __post_init__(self) -> None:
            ParameterServerConfig.__post_init__(self)
            if isinstance(self.average_interval, bool) or not isinstance(self.average_interval, int):
                raise ValueError(
                    f"--average-interval {self.average_interval!r} must be an integer number "
                    "of iterations (1 = average every step, as SHM-Learn-Dist eq. 2.2)"
                )
            if self.average_interval < 1:
                raise ValueError(
                    f"--average-interval {self.average_interval} must be >= 1: it is the number "
                    "of iterations between weight averages; use 1 to average after every step"
                )

    def __init__(self, config, ctx, model, optimizer, timer=None, *, transports=None) -> None:
        super().__init__(config, ctx, model, optimizer, timer, transports=transports)
        self.layout = FlatLayout(self.params)
        #: averaging rounds done (restored by load_state_dict)
        self.rounds = 0
        # every worker starts from rank 0's initial weights (the server's)
        self.star = self.transports.star(
            config.ps_transport, "ps_weight", self.layout.numel, self.layout.dtype, self.layout.gather()
        )
        #: this worker's weights ``w_i``: its parameters are views of them
        self.weights = self.star.mine
        self.weights.copy_(self.star.server)
        self.staging = None
        if self.staged:  # the parameters stay on their device; copies at each average
            self.staging = self.make_staging(self.layout)
            self.staging.register(self.weights)
            self._views = self.layout.views(self.weights)
            self._to_device()
        else:
            self.layout.bind_data(self.weights, copy=False)

    def _to_device(self) -> None:
        self.timer.add_copies("copy_to_device", self.staging.to_device_all(self._views, data=True))

    def _to_host(self) -> None:
        self.timer.add("copy_to_host", self.staging.to_host_all(self._views, grads=False))

    def after_update(self) -> None:
        """After this worker's own step ``w_i - eta g_i``: average every K iterations."""
        super().after_update()
        if self.iteration % self.config.average_interval == 0:
            self.average()

    def average(self) -> None:
        """One round of eq. 2.2: the server averages every worker's weights; all take the mean."""
        self.rounds += 1
        if self.staging is not None:
            self._to_host()
        self.star.mean_to_all(phase=partial(ps_phase, self.timer))  # self.weights is star.mine
        if self.staging is not None:
            self._to_device()

    def state_dict(self) -> dict[str, Any]:
        """The iteration and the averaging rounds done (the weights are the model's, the
        momentum this worker's optimizer's: both saved by their owners)."""
        return {**super().state_dict(), "rounds": self.rounds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; rank 0's (loaded) weights become the server's.

        The parameters are views of this worker's weights, so loading the model (before
        this call) has restored them; the server buffer is rewritten by every average, but
        is made rank 0's weights so every worker holds the same state."""
        super().load_state_dict(state)
        self.rounds = int(state["rounds"])
        if self.staging is not None:
            self._to_host()
        self.star.set_server(self.weights)

    def finish(self) -> None:
        """End on averaged weights; give the model private copies of them."""
        try:
            if self.iteration % self.config.average_interval:
                self.average()
        finally:
            self.release_weights()
            Strategy.finish(self)
