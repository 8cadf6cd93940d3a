"""``ssgd --overlap``: bucketed gradient allreduce started from hooks during backward.

The third overlapped option beside ``gpi`` and ``cpu_acc``, done the way PyTorch DDP
does it: parameters in reverse registration order are grouped into buckets of at most
``--bucket-mb`` MiB (the first at most 1 MiB); each parameter's post-accumulate-grad
hook copies its gradient into the bucket and, when the bucket is complete, launches
its allreduce, buckets strictly in order; after backward only the unfinished buckets
are waited for (``collect_remaining``). With ``--allreduce shm`` (default) the buckets
go through :class:`shmtrain.fabric.bucket_allreduce.BucketAllreduce` (shared memory,
gloo between hosts; its progress runs in these hooks, on the training thread: every hook
reduces this worker's share of each launched bucket whose peers' gradients have arrived,
without waiting); with ``--allreduce gloo`` through
``torch.distributed.all_reduce(async_op=True)``, exactly DDP's transport.

Unlike DDP, buckets are not rebuilt from the observed gradient order after the first
iteration; a parameter that backward did not reach is filled with zeros after backward
(DDP's ``find_unused_parameters`` result, found without a graph walk).

Staged (GPU parameters): a hook starts the copy of its gradient into the bucket on the
device-to-host stream (:class:`shmtrain.fabric.staging.HostStaging`) instead of copying
it; a complete bucket is launched once its last copy has landed (polled, never waited
for, in the hooks; waited for after backward: ``d2h_wait``), and the means go back into
``param.grad`` on the host-to-device stream, which the optimizer's stream waits for.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from shmtrain.fabric.bucket_allreduce import assign_buckets
from shmtrain.fabric.flat import FlatLayout, broadcast_parameters
from shmtrain.strategies.base import Strategy

MIB = 1 << 20


class OverlapSSGD(Strategy):
    """Synchronous SGD with bucketed allreduce overlapped with backward (not registered:
    ``ssgd`` hands a config with ``overlap`` to it, see ``SSGD.implementation``)."""

    name = "ssgd"
    synchronous = True
    allreduces = ("shm", "gloo")
    variant_reason = "overlapped buckets go through shared memory or gloo only"

    def __init__(self, config, ctx, model, optimizer, timer=None, *, transports=None) -> None:
        super().__init__(config, ctx, model, optimizer, timer, transports=transports)
        order = list(reversed(self.params))
        self.layout = layout = FlatLayout(order)
        broadcast_parameters(layout)
        itemsize = torch.empty((), dtype=layout.dtype).element_size()
        groups = assign_buckets([p.numel() * itemsize for p in order], int(config.bucket_mb * MIB))
        self.bucket_ranges = [(layout.offsets[g.start][0], layout.offsets[g.stop - 1][1]) for g in groups]
        self._bucket_of = np.zeros(len(order), dtype=np.int64)
        for b, g in enumerate(groups):
            self._bucket_of[g.start : g.stop] = b
        self._sizes = np.array([len(g) for g in groups], dtype=np.int64)
        self._slot = {id(p): i for i, p in enumerate(order)}
        self.order = order
        # one slot and one result, reused every step (see BucketAllreduce)
        self.reducer = self.transports.bucket_reducer(
            config.allreduce, layout.numel, self.bucket_ranges, layout.dtype, op="mean", tag="buckets"
        )
        self._inputs = layout.views(self.reducer.input())
        self._results = layout.views(self.reducer.result())
        self._step = 0
        self._copy_s = 0.0  # staged: device seconds of this step's copies to host
        self._seen = np.zeros(len(order), dtype=bool)
        self._pending = self._sizes.copy()
        self._next = 0  # next bucket to launch
        self.staging = None
        if self.staged:
            self.staging = self.make_staging(layout)
            self.staging.register(self.reducer.input(), self.reducer.result())
            #: staged: the copies of each bucket's gradients not yet landed
            self._landing: list[list] = [[] for _ in self._sizes]

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _begin(self) -> None:
        """Open the step lazily at its first gradient (or after backward)."""
        if self._step != self.steps + 1:
            self._step = self.steps + 1
            self._seen[:] = False
            self._pending[:] = self._sizes
            self._next = 0

    def on_gradient_ready(self, param: torch.Tensor) -> None:
        self._begin()
        i = self._slot[id(param)]
        if self.staging is not None:  # copies on one stream land in order: the last is enough
            copy = self.staging.to_host(i, param.grad, dst=self._inputs[i])[1]
            self._landing[self._bucket_of[i]].append(copy)
        else:
            self._inputs[i].copy_(param.grad)
        self._mark(i)
        if not self._launch_ready():
            self.reducer.progress()  # buckets whose peers were late at their launch

    def _mark(self, i: int) -> None:
        self._seen[i] = True
        self._pending[self._bucket_of[i]] -= 1

    def _launch_ready(self) -> bool:
        """Launch complete buckets in order (every rank issues the same sequence); True if
        any was launched."""
        first = self._next
        while self._next < len(self._sizes) and self._pending[self._next] == 0:
            if self.staging is not None and not self._landed(self._next, wait=False):
                break
            self.reducer.launch(self._next, self._step)
            self._next += 1
        return self._next > first

    def _landed(self, bucket: int, wait: bool) -> bool:
        """Staged: whether the bucket's gradients are in host memory (``wait``: block
        until they are, counting the device time of the copy)."""
        copies = self._landing[bucket]
        if copies:
            if not (wait or copies[-1].done()):  # one stream: the last issued lands last
                return False
            self._copy_s += sum(copy.wait() for copy in copies)
            copies.clear()
        return True

    def after_backward(self) -> None:
        start = time.perf_counter()
        self._begin()
        inputs = self._inputs
        for i in np.flatnonzero(~self._seen):  # parameters backward did not reach
            inputs[int(i)].zero_()
            self._mark(int(i))
        if self.staging is not None:
            waited = time.perf_counter()
            for bucket in range(self._next, len(self._sizes)):
                self._landed(bucket, wait=True)
            self.timer.add("d2h_wait", time.perf_counter() - waited)
        self._launch_ready()
        self.reducer.wait(self._step)
        if self.staging is not None:
            # the optimizer's stream waits for the copies back (timed when the iteration closes)
            self.timer.add_copies("copy_to_device", self.staging.to_device_all(self._results))
            self.timer.add("copy_to_host", self._copy_s)
            self._copy_s = 0.0
        else:
            self.layout.bind_grads(self._results)
        elapsed = time.perf_counter() - start
        self.timer.add("collect_remaining", elapsed)
        self.timer.add("comm", elapsed)

    def after_update(self) -> None:
        # The gradients are views of a buffer the peers read too: never let a next
        # backward accumulate into it, even if the loop skips zero_grad.
        for p in self.params:
            p.grad = None
        super().after_update()

    def finish(self) -> None:
        if self.staging is not None:
            self.staging.close()
        self.reducer.close()
        super().finish()
