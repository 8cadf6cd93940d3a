"""``ssgd --overlap``: bucketed gradient allreduce started from hooks during backward.

The third overlapped option beside ``gpi`` and ``cpu_acc``, done the way PyTorch DDP
does it: parameters in reverse registration order are grouped into buckets of at most
``--bucket-mb`` MiB (the first at most 1 MiB); each parameter's post-accumulate-grad
hook copies its gradient into the bucket and, when the bucket is complete, launches
its allreduce, buckets strictly in order; after backward only the unfinished buckets
are waited for (``collect_remaining``). With ``--allreduce shm`` (default) the buckets
go through :class:`shmtrain.fabric.allreduce.buckets.BucketAllreduce` (shared memory,
gloo between hosts; its progress runs in these hooks, on the training thread: every hook
reduces this worker's share of each launched bucket whose peers' gradients have arrived,
without waiting); with ``--allreduce gloo`` through
``torch.distributed.all_reduce(async_op=True)``, exactly DDP's transport.

Unlike DDP, buckets are not rebuilt from the observed gradient order after the first
iteration; a parameter that backward did not reach is filled with zeros after backward
(DDP's ``find_unused_parameters`` result, found without a graph walk).

Staged (GPU parameters): a hook only starts the copy of its gradient into the bucket on
the device-to-host stream (:class:`shmtrain.strategies.layout.staging.HostStaging`) and, when that
completes its bucket, hands the bucket to a :class:`shmtrain.strategies.layout.courier.Courier`:
that host thread waits for the bucket's copies (CUDA events), launches complete buckets in
order and reduces (the hook never waits and never reduces: backward's kernels keep
coming). Pipelined: each time the courier has launched or progressed, it starts the copy
back of every bucket whose mean is final (every local rank reduced it: one host, shared
memory) into ``param.grad`` on the host-to-device stream, so a bucket's D2H copy, its host
reduction and its H2D copy overlap the rest of backward. After backward the training
thread waits for the courier (``d2h_wait``) and the allreduce, copies back the buckets
still missing, and the optimizer's stream waits for the copies (a stream wait).

Per-bucket step (staged): right after the courier starts a bucket's mean back, it steps
that bucket's parameters (``strategies/optim/partial_step.py``: the one optimizer, restricted
to the bucket), on the training thread's stream after a stream wait for the copies back
started so far, the bucket's among them (never a host wait, nothing in a hook); the
buckets whose means land after backward are stepped in ``apply_update``. The parameters
a bucket holds are those whose gradients are complete, so backward reads them no more
(an in-place change of a weight autograd still needed would raise, not pass). For the
optimizers and settings where that equals one step after backward; otherwise
(``--grad-clip``, ``--amp fp16``, an optimizer not known to be per-parameter, the
DDP-style loop, ...) the optimizer steps once, after backward, and ``bucket_step_reason``
says why (the first iteration's ``optimizer_step`` detail in the run's metrics; with
per-bucket steps, ``buckets_stepped_early`` counts those the courier stepped).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from shmtrain.fabric.allreduce.buckets import assign_buckets
from shmtrain.fabric.exchanges.weights import broadcast_parameters
from shmtrain.strategies.base import Strategy
from shmtrain.strategies.layout.flat import FlatLayout
from shmtrain.strategies.optim.partial_step import split_groups, step_part, whole_step_reason

MIB = 1 << 20


class OverlapSSGD(Strategy):
    """Synchronous SGD with bucketed allreduce overlapped with backward (not registered:
    ``ssgd`` hands a config with ``overlap`` to it, see ``SSGD.implementation``)."""

    name = "ssgd"
    recovery = "replica"  # the weights change only in the optimizer step, after the allreduce
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
        self._groups = groups  # the parameters (indices into ``order``) of each bucket
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
            #: staged: buckets whose copies the courier saw land (it launches them in order)
            self._arrived = np.zeros(len(self._sizes), dtype=bool)
            #: staged: buckets whose means were started back to the device this step
            self._returned = np.zeros(len(self._sizes), dtype=bool)
            self.courier = self.staging.courier("shmtrain-buckets")
            #: staged: buckets whose parameters the optimizer stepped this iteration
            self._stepped = np.zeros(len(self._sizes), dtype=bool)
        self._part_of = {id(p): int(self._bucket_of[i]) for i, p in enumerate(order)}
        #: per bucket, the optimizer's groups narrowed to it (built once per iteration)
        self._parts: list[list[dict]] | None = None
        #: why this iteration's optimizer steps once, after backward; None: per bucket
        self.bucket_step_reason: str | None = "not staged: the gradients are bound to the means after backward"
        self._reported: str | None = ""  # the reason last put in the metrics ("": none yet)
        self._stream = None  # a GPU: the training thread's stream (the per-bucket steps run there)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _begin(self) -> None:
        """Open the step lazily at its first gradient (or after backward)."""
        if self._step != self.steps + 1:
            self._step = self.steps + 1
            self._seen[:] = False
            self._pending[:] = self._sizes
            self._next = 0
            if self.staging is not None:  # the courier was drained after the last backward
                self._arrived[:] = False
                self._returned[:] = False
                self._stepped[:] = False
                self._parts = None
                self.bucket_step_reason = whole_step_reason(self)
                if self.staging.cuda:
                    self._stream = torch.cuda.current_stream(self.device)

    def on_gradient_ready(self, param: torch.Tensor) -> None:
        self._begin()
        i = self._slot[id(param)]
        if self.staging is not None:  # stream-ordered work only; the rest on the courier
            copy = self.staging.to_host(i, param.grad, dst=self._inputs[i])[1]
            self._landing[self._bucket_of[i]].append(copy)
            self._mark(i)
            return
        self._inputs[i].copy_(param.grad)
        self._mark(i)
        if not self._launch_ready():
            self.reducer.progress()  # buckets whose peers were late at their launch

    def _mark(self, i: int) -> None:
        self._seen[i] = True
        bucket = int(self._bucket_of[i])
        self._pending[bucket] -= 1
        if self.staging is not None and self._pending[bucket] == 0:
            self.courier.submit(self._bucket_landed, bucket)

    def _bucket_landed(self, bucket: int) -> None:
        """Courier: wait for the bucket's copies, then launch the complete buckets in
        order (every rank issues the same sequence) and make progress on the others."""
        self._wait_copies(bucket)
        self._arrived[bucket] = True
        first = self._next
        while self._next < len(self._sizes) and self._arrived[self._next]:
            self.reducer.launch(self._next, self._step)
            self._next += 1
        if self._next == first:
            self.reducer.progress()  # buckets whose peers were late at their launch
        for b in np.flatnonzero(~self._returned[: self._next]):
            if self.reducer.reduced(int(b), self._step):
                self._copy_back(int(b))
                if self.bucket_step_reason is None:
                    self._step_bucket(int(b))

    def _copy_back(self, bucket: int) -> None:
        """Staged: start the copies of the bucket's means into its parameters' ``param.grad``."""
        for i in self._groups[bucket]:
            self.staging.to_device(i, self.order[i], self._results[i])
        self._returned[bucket] = True

    def _step_bucket(self, bucket: int) -> None:
        """Staged: step the bucket's parameters (their means started back already), on the
        training thread's stream after the copies back started so far."""
        if self._parts is None:
            self._parts = split_groups(self.optimizer, self._part_of, len(self._sizes))
        if self._stream is not None:
            self.staging.join(self._stream)  # a stream wait: the bucket's copies back come first
            with torch.cuda.stream(self._stream):
                step_part(self.optimizer, self._parts[bucket])
        else:
            step_part(self.optimizer, self._parts[bucket])
        self._stepped[bucket] = True

    def _launch_ready(self) -> bool:
        """Launch complete buckets in order (every rank issues the same sequence); True if
        any was launched."""
        first = self._next
        while self._next < len(self._sizes) and self._pending[self._next] == 0:
            self.reducer.launch(self._next, self._step)
            self._next += 1
        return self._next > first

    def _wait_copies(self, bucket: int) -> None:
        """Staged (the courier): block until the bucket's gradients are in host memory,
        counting the device time of their copies."""
        copies = self._landing[bucket]
        self._copy_s += sum(copy.wait() for copy in copies)
        copies.clear()

    def after_backward(self) -> None:
        start = time.perf_counter()
        self._begin()
        inputs = self._inputs
        for i in np.flatnonzero(~self._seen):  # parameters backward did not reach
            inputs[int(i)].zero_()  # (their bucket is incomplete: the courier has not read it)
            self._mark(int(i))
        if self.staging is not None:  # the copies and launches backward left to the courier
            self.timer.add("d2h_wait", self.courier.drain(self.ctx.timeout))
        else:
            self._launch_ready()
        self.reducer.wait(self._step)
        if self.staging is not None:
            for b in np.flatnonzero(~self._returned):  # the means not started back in backward
                self._copy_back(int(b))
            # the optimizer's stream waits for the copies back (timed when the iteration closes)
            self.staging.join()
            self.timer.add_copies("copy_to_device", self.staging.take_copies())
            self.timer.add("copy_to_host", self._copy_s)
            self._copy_s = 0.0
        else:
            self.layout.bind_grads(self._results)
        elapsed = time.perf_counter() - start
        self.timer.add("collect_remaining", elapsed)
        self.timer.add("comm", elapsed)

    def apply_update(self) -> None:
        """The one step after backward, or (per-bucket steps) the steps of the buckets whose
        means landed after backward, in bucket order."""
        reason = self.bucket_step_reason
        if reason != self._reported:  # the first iteration, and when the reason changes
            self.timer.detail("optimizer_step", f"per bucket ({len(self._sizes)} buckets)" if reason is None
                              else f"after backward ({reason})")
            self._reported = reason
        if self.staging is None or reason is not None:
            self.step_optimizer()
            return
        # the buckets the courier stepped as their means landed (the others are stepped here)
        self.timer.detail("buckets_stepped_early", int(self._stepped.sum()))
        for b in np.flatnonzero(~self._stepped):
            self._step_bucket(int(b))

    def after_update(self) -> None:
        # The gradients are views of a buffer the peers read too: never let a next
        # backward accumulate into it, even if the loop skips zero_grad.
        for p in self.params:
            p.grad = None
        super().after_update()

    def finish(self) -> None:
        if self.staging is not None:
            self.courier.close()
            self.staging.close()
        self.reducer.close()
        super().finish()
