"""Collect and accumulate gradients on CPUs during backward (IBM TRL, CPU-ACC).

Algorithm 5 (the training loop): broadcast the parameters once; then per iteration
forward, backward, ``collectRemainingGradsFromCPU()``, and the same update on every
worker, so the weights stay identical without another broadcast.

Algorithm 6 (backward): as each layer's gradient is produced, it leaves the worker for
the host's accumulator (GPU: ``MemcpyD2HAsync`` on its own stream into pinned memory,
then a callback on that stream; CPU: the gradient already is in host memory, so the
hand-off is a queue entry, no copy), and every layer whose accumulation is finished
comes back to the worker while backward goes on (GPU: ``MemcpyH2DAsync`` on another
stream; CPU: the worker's ``param.grad`` becomes a view of the shared sum, no copy; it
is dropped after the update so no later backward accumulates into shared memory).

Algorithm 7 (accumulation): one accumulator thread per worker ("a CPU thread per GPU")
adds its worker's partial gradient, scaled by 1/N so the result is the mean, into the
host's global gradient of that layer, a shared segment, inside the layer's critical
section with a counter (:mod:`shmtrain.fabric.exchanges.critical`); the first arrival of an
iteration writes instead of adding, so nothing is zeroed. ``isUpdated(u)`` is
``counter[u] >= workers * k`` in this process's k-th exchange (counters are cumulative,
never reset). The global gradients alternate between two sets by parity: a worker
reaches exchange k+2 only after everyone finished k+1, i.e. after everyone read back
exchange k's sums. The protocol numbers its rounds by ``steps`` (the exchanges of this
process, starting at 0 with the fresh counters), not by ``iteration``, which a resumed
run restores.

Every device-specific copy (pinned buffers, the D2H and H2D streams, CUDA events,
page-locking the shared segment) goes through :class:`shmtrain.strategies.layout.staging.HostStaging`.

Hand-offs are queued in batches: a large layer goes to the accumulator thread at once,
small ones (a BatchNorm's 64 weights) together once ``HANDOFF_BATCH`` elements are
waiting, and the rest right after backward. Each queue entry wakes the thread, and on a
machine whose cores all run backward every wake-up takes a core from a compute thread
(ResNet-18: 62 queue entries per iteration per worker unbatched, 11 batched).

Timings (TRL Tables 3 and 4): ``broadcast`` (once, in the first row), ``collect_remaining``
(the wait after backward; also counted in ``comm``), ``accumulate`` (seconds this
worker's accumulator thread spent adding, in the background), and per layer, under the
``layers`` detail: ``copy_s`` (hand-off, or the D2H copy on a GPU), ``lock_wait_s``,
``accumulate_s`` and ``copy_back_s``.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from shmtrain.fabric.exchanges.weights import broadcast_parameters
from shmtrain.strategies.base import Strategy, StrategyConfig, register
from shmtrain.strategies.layout.flat import FlatLayout

#: small layers are handed to the accumulator thread together once this many elements wait
HANDOFF_BATCH = 1 << 18


@register
class CPUAccumulation(Strategy):
    """Synchronous SGD; gradients summed by host threads while backward runs."""

    name = "cpu_acc"
    synchronous = True
    #: a worker killed on one host is replaced in place: every worker applies the same update
    #: (Algorithm 5) once the accumulation that held every worker's gradient is complete
    recovery = "replica"

    @dataclass(kw_only=True, slots=True)
    class Config(StrategyConfig):
        """``cpu_acc`` has no options: one accumulator thread per worker, as in the paper."""

    def __init__(self, config, ctx, model, optimizer, timer=None, *, transports=None) -> None:
        super().__init__(config, ctx, model, optimizer, timer, transports=transports)
        self.world = ctx.local_world
        self.me = ctx.local_rank
        self.layout = layout = FlatLayout(self.params)
        self.num_layers = n = len(self.params)
        start = time.perf_counter()
        broadcast_parameters(layout)  # Algorithm 5, line 2: the only broadcast
        self.timer.add("broadcast", time.perf_counter() - start)
        accumulator = self.transports.accumulator(layout.numel, layout.dtype, n, tag="cpu_acc")
        self.segment, self.critical, flats = accumulator.segment, accumulator.critical, accumulator.sums
        self.global_grads = [layout.views(f) for f in flats]
        self._accumulated = self.transports.channel("cpu_acc.accumulated")
        names = {id(p): name for name, p in model.named_parameters()}
        self._names = [names.get(id(p), f"param{i}") for i, p in enumerate(self.params)]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        # p_grads (pinned on a GPU) and the copy streams; the shared sums page-locked so
        # MemcpyH2DAsync from them is asynchronous
        self.staging = self.make_staging(layout)
        self.staging.register(*flats)
        # Per-iteration bookkeeping (main thread) and per-layer stats (thread writes its
        # own before publishing the counter, so the main thread reads them afterwards).
        self._handed = np.zeros(n, dtype=bool)
        self._returned = np.zeros(n, dtype=bool)
        self._order: list[int] = []
        self._copy_s = np.zeros(n)
        self._copy_back_s = np.zeros(n)
        self._lock_wait_s = np.zeros(n)
        self._accumulate_s = np.zeros(n)
        self._done_total = 0
        # the mean over the whole job: each host's sum is already scaled by 1/N
        self._scale = 1.0 / ctx.world_size
        # A layer's counter moves once per local accumulation and, across hosts, once
        # more when the leader has summed it with the other hosts (HostCombiner).
        self._per_round = self.world + (1 if ctx.num_nodes > 1 else 0)
        self._combiner = self.transports.host_combiner(
            range(n - 1, -1, -1), lambda layer, k: self.global_grads[k % 2][layer], self._combined,
            ready=self._host_sum_ready, name="cpu-acc-hosts")
        self._error: BaseException | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._batch: list[tuple] = []  # hand-offs not yet queued
        self._batch_numel = 0
        self._thread = threading.Thread(target=self._accumulate_loop, name="shmtrain-cpu-acc", daemon=True)
        self._thread.start()

    # -- Algorithm 6, on the training thread ---------------------------------------------
    def on_gradient_ready(self, param: torch.Tensor) -> None:
        layer = self._index[id(param)]
        self._hand_off(layer, param.grad)
        self._return_finished()

    def _hand_off(self, layer: int, grad: torch.Tensor) -> None:
        seq = self.steps + 1
        start = time.perf_counter()
        partial, handle = self.staging.to_host(layer, grad)  # MemcpyD2HAsync on a GPU
        self._batch.append((layer, seq, partial, handle))
        if handle is None:  # host memory: the hand-off is the queue entry, no copy to time
            self._copy_s[layer] = time.perf_counter() - start
        self._handed[layer] = True
        self._order.append(layer)
        self._batch_numel += grad.numel()
        if self._batch_numel >= HANDOFF_BATCH:
            self._flush()

    def _flush(self) -> None:
        """Queue the waiting hand-offs for the accumulator thread (one wake-up)."""
        if self._batch:
            self._queue.put(self._batch)
            self._batch, self._batch_numel = [], 0

    def _return_finished(self) -> None:
        """Lines 7-10: bring back every handed-off layer whose sum is complete."""
        target = self._per_round * (self.steps + 1)
        ready = self._handed & ~self._returned & (self.critical.counters >= target)
        for layer in np.flatnonzero(ready):
            self._copy_back(int(layer))

    def _copy_back(self, layer: int) -> None:
        p = self.params[layer]
        total = self.global_grads[(self.steps + 1) % 2][layer]
        start = time.perf_counter()
        # GPU: MemcpyH2DAsync into p.grad (timed by events, see _report). Host memory:
        # where the sum already is, so the worker's gradient becomes a view of it
        # (read-only for the optimizer), no copy.
        self.staging.to_device(layer, p, total)
        if not self.staging.copies:
            self._copy_back_s[layer] = time.perf_counter() - start
        self._returned[layer] = True

    # -- Algorithm 7, on the accumulator thread -----------------------------------------
    def _accumulate_loop(self) -> None:
        try:
            if self.staging.cuda:  # its event waits use the model's GPU, not GPU 0's context
                torch.cuda.set_device(self.staging.device)
            while True:
                batch = self._queue.get()
                if batch is None:
                    return
                for item in batch:
                    self._accumulate(*item)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self._error = exc

    def _accumulate(self, layer: int, seq: int, partial: torch.Tensor, handle: object | None) -> None:
        """Algorithm 7 for one layer: add the partial inside the layer's critical section."""
        if handle is not None:  # wait until the D2H copy has landed in pinned memory
            self._copy_s[layer] = self.staging.host_ready(handle)
        deadline = time.monotonic() + self.ctx.timeout
        start = time.perf_counter()
        self.critical.acquire(layer, deadline=deadline, check=self._check,
                              what=f"the global gradient of layer {layer}")
        entered = time.perf_counter()
        count = int(self.critical.counters[layer])
        target = self.global_grads[seq % 2][layer]
        # The mean, as a sum of partials scaled by 1/N (no pass after the last one);
        # the first arrival of the iteration writes instead of adding.
        if count % self._per_round == 0:
            torch.mul(partial, self._scale, out=target)
        else:
            target.add_(partial, alpha=self._scale)
        self._lock_wait_s[layer] = entered - start
        self._accumulate_s[layer] = time.perf_counter() - entered
        self.critical.release(layer, count + 1)
        self._done_total += 1
        self.transports.control().post(self._accumulated, self.me, self._done_total)

    # -- across hosts: the leader's combiner thread (HostCombiner) -------------------
    def _host_sum_ready(self, layer: int, k: int, check) -> None:
        """This host's workers have all added their partials of ``layer`` in round ``k``."""
        self.critical.wait_count(layer, self._per_round * (k - 1) + self.world, deadline=float("inf"),
                                 check=check, what=f"this host's sum of layer {layer}",
                                 name_peer=self._laggards)

    def _combined(self, layer: int, k: int) -> None:
        """The job's sum of ``layer`` is in place: one more count wakes the host's workers."""
        self.critical.acquire(layer, deadline=time.monotonic() + self.ctx.timeout, check=self._check,
                              what=f"the global gradient of layer {layer}")
        self.critical.release(layer, int(self.critical.counters[layer]) + 1)

    # -- collectRemainingGradsFromCPU ------------------------------------------------------
    def after_backward(self) -> None:
        start = time.perf_counter()
        for layer in np.flatnonzero(~self._handed):  # parameters backward did not reach
            p = self.params[int(layer)]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._hand_off(int(layer), p.grad)
        self._flush()
        target = self._per_round * (self.steps + 1)
        deadline = time.monotonic() + self.ctx.timeout
        for layer in self._order:
            if self._returned[layer]:
                continue
            self.critical.wait_count(
                layer, target, deadline=deadline, check=self._check,
                what=f"the sum of layer {layer} ({self._names[layer]})", name_peer=self._laggards,
            )
            self._copy_back(layer)
        self.staging.join()  # the update runs after the H2D copies (a stream wait)
        elapsed = time.perf_counter() - start
        self.timer.add("collect_remaining", elapsed)
        self.timer.add("comm", elapsed)
        self._report(elapsed)

    def _check(self) -> None:
        """Raise if the accumulator thread failed, the host aborted, or a peer died."""
        if self._error is not None and threading.current_thread() is not self._thread:
            raise self._error
        if self._combiner is not None:
            self._combiner.check()
        self.transports.control().check_peers(self.me, "gradient accumulation")

    def _laggards(self) -> str:
        control = self.transports.control()
        expected = self.num_layers * (self.steps + 1)
        late = [r for r in range(self.world) if control.get(self._accumulated, r) < expected]
        if not late and self._per_round > self.world:
            return "the other hosts (their leaders' sum)"
        return "local rank(s) " + ", ".join(map(str, late or range(self.world)))

    def _report(self, remaining: float) -> None:
        for layer, seconds in self.staging.device_times():
            self._copy_back_s[layer] = seconds
        self.timer.add("accumulate", float(self._accumulate_s.sum()))
        if self.staging.copies:  # TRL Table 4's copies, summed; what backward left: all of
            # collect_remaining (the copies still in flight, the last sums and copies back)
            self.timer.add("copy_to_host", float(self._copy_s[self._order].sum()))
            self.timer.add("copy_to_device", float(self._copy_back_s[self._order].sum()))
            self.timer.add("d2h_wait", remaining)
        self.timer.detail("layers", [
            {"layer": self._names[i], "numel": self.params[i].numel(),
             "copy_s": float(self._copy_s[i]), "lock_wait_s": float(self._lock_wait_s[i]),
             "accumulate_s": float(self._accumulate_s[i]), "copy_back_s": float(self._copy_back_s[i])}
            for i in self._order
        ])

    # -- closing the iteration ----------------------------------------------------------------
    def after_update(self) -> None:
        if not self.staging.copies:  # the gradients are views of the shared sums: never accumulate there
            for p in self.params:
                p.grad = None
        self._handed[:] = False
        self._returned[:] = False
        self._order.clear()
        super().after_update()

    def finish(self) -> None:
        if self._combiner is not None:
            self._combiner.close()
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=self.ctx.timeout)
        self.staging.close()  # undo the page-locking of the shared sums
        super().finish()
