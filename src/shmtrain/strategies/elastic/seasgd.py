"""SEASGD: shared-memory elastic averaging SGD (ShmCaffe eqs. (5)-(7), Fig. 6).

Per worker x, every ``update_interval`` iterations, with W'_x its weights after the
last local SGD step (eq. (2)) and alpha the ``moving_rate``::

    dW_x  = alpha (W'_x - W_g)      (5)   weight increment
    W''_x = W'_x - dW_x             (6)   local weights move towards the global ones
    W'_g  = W_g + dW_x              (7)   global weights move towards the local ones

Fig. 6, two threads per worker. The *main thread* reads W_g at the start of an
iteration (T1, phase ``rgw``), computes dW_x and updates its weights (T2, ``ulw``),
wakes the update thread (T3), trains the mini-batch (T4) and applies its gradient
(T5; both in ``compute``). The *update thread* writes dW_x into the worker's own
buffer on the service (T.A1, ``wwi``), asks the service to accumulate it into W_g
(T.A2), which the service's owner applies exclusively (T.A3), waits for the
notification (T.A4, together ``ugw``), and wakes the main thread (T.A5). T1+T2 and
T.A1-T.A4 are mutually exclusive; when the update is still running as the next
exchange starts, the main thread waits before T1/T2 (``wait``). The read of W_g is
not hidden behind computation (staleness hurts learning, Section III-G).

Eq. (8): T_iter = max[T_comp, T_wwi + T_ugw] + T_rgw + T_ulw; :func:`check_eq8`
checks it on the metrics rows.

Staged (GPU parameters, :class:`shmtrain.strategies.layout.staging.HostStaging`): the main thread
reads W_g into the GPU (T1), applies eq. (6) there (T2) and starts the copy of the
difference into a pinned host buffer on the device-to-host stream; the update thread
waits for that copy, then scales, writes and accumulates dW_x in host memory only
(T.A1-T.A4), so it never touches the GPU.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from shmtrain.fabric.shm.control import PeerTimeout
from shmtrain.fabric.smb import Buffer, BufferService
from shmtrain.fabric.smb.compressed import CompressedGlobal
from shmtrain.strategies.base import register
from shmtrain.strategies.elastic.eq8 import Eq8Metrics
from shmtrain.strategies.elastic.shared_weights import ElasticConfig, SharedWeightsStrategy
from shmtrain.strategies.layout.staging import HostStaging
from shmtrain.timing import PhaseTimer


class ElasticExchange:
    """The main-thread / update-thread exchange of Fig. 6 for one flat weight tensor.

    Args:
        service: the buffer service.
        global_weights: W_g on the service.
        weight_increment: this worker's dW_x buffer on the service.
        weights: the local weights W_x (updated in place).
        moving_rate: alpha.
        timer: receives ``wait``, ``rgw``, ``ulw`` (main thread) and ``wwi``, ``ugw``
            (update thread; added when the main thread next picks the update up).
        timeout: seconds the main thread waits for the update thread.
        staging: staged (a GPU, or ``copy`` mode): the difference leaves the device through
            it, and the update thread works on a host copy; None: it shares ``weights``'
            memory.
        compressed: ``--compress`` across a link
            (:class:`~shmtrain.fabric.smb.compressed.CompressedGlobal`): T1 reads W_g as this
            worker's mirror, brought up to date by a compressed difference, and T.A1-T.A4
            send C(dW_x + e_x) (applied by the server, eq. (7)); None: whole buffers.
    """

    def __init__(
        self,
        service: BufferService,
        global_weights: Buffer,
        weight_increment: Buffer,
        weights: torch.Tensor,
        moving_rate: float,
        timer: PhaseTimer,
        timeout: float,
        staging: HostStaging | None = None,
        compressed: CompressedGlobal | None = None,
    ) -> None:
        self.service = service
        self.compressed = compressed
        self.global_weights = global_weights
        self.weight_increment_buffer = weight_increment
        self.weights = weights
        self.moving_rate = moving_rate
        self.timer = timer
        self.timeout = timeout
        self.global_copy = torch.empty_like(weights)
        self.weight_increment = torch.zeros_like(weights)
        self.staging = staging
        #: what the update thread scales and writes: the difference itself, or its host copy
        self.host_increment = (staging.host_buffer(weights.numel(), weights.dtype)
                               if self.staging is not None else self.weight_increment)
        self._landing = None  # staged: the copy of the difference to the host
        self._cond = threading.Condition()
        self._pending = False  # an increment waits for / is in the update thread
        self._stop = False
        self._error: BaseException | None = None
        self._times: dict[str, float] = {}
        self.exchanges = 0
        self._thread = threading.Thread(target=self._update_loop, name="seasgd-update", daemon=True)
        self._thread.start()

    def exchange(self) -> None:
        """Main thread, T1-T3: read W_g, apply eqs. (5)-(6), hand dW_x to the update thread."""
        start = time.perf_counter()
        self._await_idle("the previous global weight update")
        with self._cond:
            times, self._times = self._times, {}
        waited = time.perf_counter() - start
        for name, seconds in times.items():
            self.timer.add(name, seconds)
        t1 = time.perf_counter()
        if self.compressed is not None:  # T1 across the link: the mirror, updated by a compressed difference
            self.compressed.read(self.global_copy)
        else:
            self.service.read(self.global_weights, self.global_copy)  # T1
        t2 = time.perf_counter()
        difference = self.weight_increment
        torch.sub(self.weights, self.global_copy, out=difference)
        # (6), T2: W'' = W' - alpha (W' - W_g); the update thread scales the difference
        # into dW_x (5) itself, one pass over the weights fewer on the critical path
        self.weights.sub_(difference, alpha=self.moving_rate)
        if self.staging is not None:  # the update thread works on a host copy
            self._landing = self.staging.copy_to_host(self.host_increment, difference)
        t3 = time.perf_counter()
        self.timer.add("wait", waited)
        self.timer.add("rgw", t2 - t1)
        self.timer.add("ulw", t3 - t2)
        self.timer.add("comm", waited + t3 - t1)
        with self._cond:  # T3
            self._pending = True
            self.exchanges += 1
            self._cond.notify_all()

    def _await_idle(self, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while self._pending and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    server = getattr(self.service, "address", None)
                    if server is not None:  # its requests wait for the memory server, not for a worker
                        raise PeerTimeout(f"the memory server at {server} did not answer within "
                                          f"{self.timeout:.0f} s: the SEASGD update thread did not finish {what}",
                                          server=server)
                    raise PeerTimeout(f"the SEASGD update thread did not finish {what} within {self.timeout:.0f} s")
                self._cond.wait(left)
            if self._error is not None:
                raise self._error

    def _update_loop(self) -> None:
        """Update thread, T.A1-T.A5 (sleeps on a condition between updates)."""
        if self.staging is not None and self.staging.cuda:  # its event waits: the model's GPU
            torch.cuda.set_device(self.staging.device)
        while True:
            with self._cond:
                while not self._pending and not self._stop:
                    self._cond.wait()
                if not self._pending:
                    return
            times: dict[str, float] = {}
            try:
                t0 = time.perf_counter()
                if self._landing is not None:
                    self._landing.wait()
                self.host_increment.mul_(self.moving_rate)  # (5)
                if self.compressed is not None:  # T.A1-T.A4 in one: C(dW_x + e_x), applied by the server
                    t1 = time.perf_counter()
                    self.compressed.accumulate(self.host_increment)
                else:
                    self.service.write(self.weight_increment_buffer, self.host_increment)  # T.A1
                    t1 = time.perf_counter()
                    ticket = self.service.accumulate(self.weight_increment_buffer, self.global_weights)
                    self.service.wait(ticket)  # T.A2-T.A4: (7), applied by the service's owner
                t2 = time.perf_counter()
                times = {"wwi": t1 - t0, "ugw": t2 - t1}
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                self._error = exc
            with self._cond:  # T.A5
                for name, seconds in times.items():
                    self._times[name] = self._times.get(name, 0.0) + seconds
                self._pending = False
                self._cond.notify_all()

    def drain(self) -> None:
        """Sleep until the increment in flight has been applied to W_g (if any)."""
        self._await_idle("the global weight update in flight")

    def close(self) -> None:
        """Let the last update finish, then end the update thread."""
        try:
            self._await_idle("the last global weight update")
        finally:
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            self._thread.join(timeout=self.timeout)
            if self.staging is not None:
                self.staging.close()


@register
class SEASGD(Eq8Metrics, SharedWeightsStrategy):
    """Asynchronous elastic averaging through the shared buffer service (Fig. 6)."""

    name = "seasgd"

    @dataclass(kw_only=True, slots=True)
    class Config(ElasticConfig):
        pass

    def __init__(self, config, ctx, model, optimizer, timer=None, *, transports=None) -> None:
        super().__init__(config, ctx, model, optimizer, timer, transports=transports)
        self.exchange = ElasticExchange(
            self.service, self.global_weights, self.weight_increment, self.weights,
            config.moving_rate, self.timer, ctx.timeout,
            self.make_staging(self.layout) if self.staged else None, self.compressed,
        )

    def start_iteration(self) -> None:
        if self.iteration % self.config.update_interval == 0:
            self.exchange.exchange()

    def drain_exchange(self) -> None:
        self.exchange.drain()

    def close_exchange(self) -> None:
        self.exchange.close()
