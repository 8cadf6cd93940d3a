"""SUB-BATCH: a worker's mini-batch split over K threads, their gradients averaged inside
the process before the workers communicate (swCaffe Section V-A, Algorithm 1, Fig. 5).

swCaffe starts one thread per core group of a processor; thread i runs forward and
backward on its quarter of the mini-batch, the gradients are averaged in the process
(Algorithm 1, line 8: ``G_t^k = 1/4 sum_i grad f(x_i; w_t)``), and only that average
takes part in the allreduce among processors (line 9). :class:`SubBatch` does this for
any model and any strategy:

- **Replicas.** Thread ``k`` runs replica ``k`` of the model: a copy whose parameters
  are leaf tensors sharing storage with the model's (the weights are not copied; they are
  re-pointed before an iteration when a strategy has moved the model's parameters into
  shared memory), with buffers of its own. ``torch.func.functional_call`` would swap the
  model's attributes while it runs, which K threads cannot do at once.
- **Weights of the parts.** The batch of ``N`` samples is split into ``K`` parts whose
  sizes differ by at most one; part ``k`` backpropagates ``(n_k / N) * loss_k`` (a loss
  averaged over the batch; ``loss_k`` for a summed one), so the sum of the K gradients
  is the gradient of the whole batch, also when ``K`` does not divide ``N``.
- **Delivery, hooks and overlap.** Post-accumulate-grad hooks on the replicas' parameters
  report each part's gradient as its backward produces it. Once all K parts hold a
  parameter's gradient, the training thread adds them and hands the sum to the model's
  own parameter with ``torch.autograd.backward(param, sum)``: AccumulateGrad writes it
  into ``param.grad`` (in place into a strategy's shared-memory slot when one is bound)
  and the strategy's post-accumulate-grad hooks fire with the full averaged gradient, on
  the training thread, in the order backward produces the gradients. The strategies that
  communicate inside backward (``ssgd --overlap``, ``gpi``, ``cpu_acc``) therefore keep
  their overlap: a layer is communicated while the threads compute the layers before it.
  A parameter no part reached gets no gradient (as in a plain backward); one that only
  some parts reached gets the sum of theirs.
- **Threads.** K threads of a pool made once (``close()`` ends them), each running torch
  operations with torch's intra-op thread count (``--threads``); the training thread sleeps
  on a queue while they compute and wakes for each complete gradient.
- **Batch norm.** Each part normalizes with its own batch statistics, as K devices without
  synchronized batch norm would (and swCaffe's core groups, each running every layer on
  its quarter). Every replica starts the iteration from the model's running statistics,
  and the model's floating-point buffers become the size-weighted mean of the replicas'
  (``b_0 + sum_k n_k/N (b_k - b_0)``, exact for a buffer no part changed). For
  ``running_mean`` that is exactly one thread's update (the weighted mean of the parts'
  means is the batch mean); ``running_var`` becomes the mean of the parts' variances,
  which leaves out the spread between the parts' means. Integer buffers
  (``num_batches_tracked``) are taken from the first part: one count per iteration.
  Random layers (dropout) draw from the shared generator in whatever order the threads
  reach it, so their masks differ from one thread's.
- **Timing.** ``forward`` runs until every part's forward has finished (the strategy's
  ``before_forward`` included), ``backward`` from there until the last gradient is
  delivered (the delivery's hooks, hence overlapped communication, included).
"""

from __future__ import annotations

import copy
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch
from torch import nn

from shmtrain.timing import PhaseTimer

#: what a part thread puts on the queue, instead of a parameter index, when it ends
_DONE, _FAILED = -1, -2


def replica(model: nn.Module, params: list[torch.Tensor]) -> tuple[nn.Module, list[torch.Tensor]]:
    """A copy of ``model`` whose parameters share the model's storage (new leaf tensors,
    so a thread's autograd never touches the model's own), with buffers of its own; and
    the copy's counterparts of ``params``, in their order."""
    memo: dict[int, Any] = {id(p): nn.Parameter(p.detach(), requires_grad=p.requires_grad)
                            for p in model.parameters()}
    return copy.deepcopy(model, memo), [memo[id(p)] for p in params]


class SubBatch:
    """Forward and backward of one mini-batch in K threads; the averaged gradient reaches
    the model's parameters through their AccumulateGrad, hooks included (swCaffe
    Algorithm 1, lines 1-8; the inter-worker allreduce, line 9, is the strategy's).

    Args:
        model: the model whose parameters receive the gradient (``DataParallel.module``).
        parts: K, the threads the mini-batch is split over (``--sub-batch``).
        loss_fn: ``loss_fn(output, target)``, averaged (``reduction="mean"``) or summed
            (``"sum"``) over the samples.
        timer: receives ``forward`` and ``backward``.
    """

    def __init__(self, model: nn.Module, parts: int, loss_fn: Callable[..., torch.Tensor],
                 timer: PhaseTimer | None = None, *, bf16: bool = False) -> None:
        if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
            raise ValueError(f"--sub-batch {parts!r}: the mini-batch is split over K threads, so K "
                             "must be an integer of at least 1; use e.g. --sub-batch 2")
        reduction = getattr(loss_fn, "reduction", "mean")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"--sub-batch {parts}: the loss has reduction={reduction!r}, but the parts' "
                             "gradients are combined as a mean or a sum over the samples; use "
                             "reduction='mean' or 'sum', or --sub-batch 1")
        self.model = model
        self.parts = parts
        self.loss_fn = loss_fn
        self.bf16 = bf16  # autocast is per thread: each part enters its own
        self.mean = reduction == "mean"
        self.timer = timer or PhaseTimer()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.replicas: list[nn.Module] = []
        self._replica_params: list[list[torch.Tensor]] = []
        for k in range(parts):
            copy_k, shared = replica(model, self.params)
            for i, q in enumerate(shared):
                q.register_post_accumulate_grad_hook(self._reporter(k, i))
            self.replicas.append(copy_k)
            self._replica_params.append(shared)
        self._buffers = [b for _, b in model.named_buffers()]
        self._replica_buffers = [[b for _, b in r.named_buffers()] for r in self.replicas]
        self._modules = list(model.modules())
        self._replica_modules = [list(r.modules()) for r in self.replicas]
        self._queue: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self._forward_end = [0.0] * parts
        self.pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=parts, thread_name_prefix="shmtrain-subbatch")
        # the first backward given grad_tensors imports sympy (0.5 s): here, not in the
        # first iteration, where it would hold back the first delivery
        torch.autograd.backward(torch.zeros((), requires_grad=True), torch.ones(()))

    # -- one iteration --------------------------------------------------------------
    def step(self, x: torch.Tensor, y: torch.Tensor,
             before_forward: Callable[[], None] | None = None) -> torch.Tensor:
        """Forward and backward of ``(x, y)`` in K parts; the gradient of the whole batch is
        accumulated into the model's parameters. Returns the loss of the whole batch
        (detached). ``before_forward``: the strategy's work before the forward pass."""
        if self.pool is None:
            raise RuntimeError("SubBatch.step after close()")
        start = time.perf_counter()
        if before_forward is not None:
            before_forward()
        xs, ys = x.tensor_split(min(self.parts, len(x))), y.tensor_split(min(self.parts, len(x)))
        total = len(x)
        weights = [len(part) / total if self.mean else 1.0 for part in xs]
        self._prepare(len(xs))
        self._queue = reports = queue.SimpleQueue()
        futures = [self.pool.submit(self._part, k, xs[k], ys[k], weights[k], reports)
                   for k in range(len(xs))]
        try:
            self._collect(futures, reports)
        finally:
            wait(futures)  # no thread may still run on the model once this returns
        losses = [f.result() for f in futures]  # the first part's error, if any
        self._average_buffers([len(part) / total for part in xs])
        forward = max(self._forward_end[: len(xs)]) - start
        self.timer.add("forward", forward)
        self.timer.add("backward", time.perf_counter() - start - forward)
        return torch.stack(losses).sum()

    def _prepare(self, used: int) -> None:
        """Point the replicas at the model's current weights, buffers and modes."""
        for k in range(used):
            for p, q in zip(self.params, self._replica_params[k], strict=True):
                if q.data_ptr() != p.data_ptr():  # a strategy re-pointed the parameter
                    q.data = p.data
                q.grad = None
            with torch.no_grad():
                for b, c in zip(self._buffers, self._replica_buffers[k], strict=True):
                    c.copy_(b)
            for m, r in zip(self._modules, self._replica_modules[k], strict=True):
                r.training = m.training

    def _part(self, k: int, x: torch.Tensor, y: torch.Tensor, weight: float,
              reports: queue.SimpleQueue) -> torch.Tensor:
        """Thread ``k``: forward and backward of its part (Algorithm 1, lines 3-6)."""
        ended = _FAILED
        try:
            with torch.enable_grad():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
                    loss = self.loss_fn(self.replicas[k](x), y)
                self._forward_end[k] = time.perf_counter()
                weighted = loss * weight
                weighted.backward(inputs=self._replica_params[k])
            ended = _DONE
            return weighted.detach()
        finally:
            reports.put((k, ended))

    def _reporter(self, k: int, i: int) -> Callable[[torch.Tensor], None]:
        def report(_: torch.Tensor) -> None:
            self._queue.put((k, i))
        return report

    def _collect(self, futures: list[Future], reports: queue.SimpleQueue) -> None:
        """Training thread: deliver each parameter's gradient once every part has it
        (Algorithm 1, line 8), then the ones only some parts reached."""
        used = len(futures)
        counts = [0] * len(self.params)
        finished, failed = 0, False
        while finished < used:
            try:  # every part reports its end, whatever way it ends (``_part``'s finally)
                _, i = reports.get(timeout=1.0)
            except queue.Empty:  # a part still computes
                continue
            if i < 0:
                finished += 1
                failed = failed or i == _FAILED
                continue
            counts[i] += 1
            if counts[i] == used:
                self._deliver(i, used)
        if failed:
            return  # step() raises the part's error
        for i, count in enumerate(counts):
            if 0 < count < used:
                self._deliver(i, used)

    def _deliver(self, i: int, used: int) -> None:
        """Sum parameter ``i``'s part gradients and accumulate the sum into the model's
        parameter, firing its hooks."""
        grads = [g for k in range(used) if (g := self._replica_params[k][i].grad) is not None]
        total = grads[0] if len(grads) == 1 else torch.add(grads[0], grads[1])
        for g in grads[2:]:
            total.add_(g)
        for k in range(used):
            self._replica_params[k][i].grad = None
        torch.autograd.backward(self.params[i], total)

    def _average_buffers(self, sizes: list[float]) -> None:
        """The model's buffers: the size-weighted mean of the replicas' (floating point),
        the first replica's (integers, e.g. ``num_batches_tracked``)."""
        used = len(sizes)
        with torch.no_grad():
            for j, b in enumerate(self._buffers):
                first = self._replica_buffers[0][j]
                if not b.is_floating_point() or used == 1:
                    b.copy_(first)
                    continue
                mean = first.clone()
                for k in range(1, used):
                    mean.add_(self._replica_buffers[k][j] - first, alpha=sizes[k])
                b.copy_(mean)

    def close(self) -> None:
        """End the threads (idempotent)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
