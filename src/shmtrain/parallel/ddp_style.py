"""A plain DDP loop on :class:`shmtrain.parallel.data_parallel.DataParallel`: ``optimizer.step()`` is the step.

:class:`DDPStyle` gives a wrapped model DistributedDataParallel's contract, so a DDP
script converts by changing its wrapper line only (docs/convert_ddp.md)::

    optimizer.zero_grad(); loss.backward(); clip_grad_norm_(...); optimizer.step()

- **Averaged in backward** (the ``synchronous`` strategies: ssgd and its variants, gpi,
  cpu_acc, ps_grad): a tensor hook on every parameter notices the first gradient of a
  backward and queues an autograd callback (``Variable._execution_engine.queue_callback``,
  as DDP's reducer does); at the end of backward it runs the strategy's
  ``after_backward``, so ``param.grad`` holds the job's mean when ``backward()`` returns.
  Unstaged, those gradients may be views of shared memory other ranks read (a result
  slot, a shared sum: ``Strategy.shared_gradients``); they become private copies first,
  so an in-place ``clip_grad_norm_`` on one rank corrupts nobody's.
- **The optimizer wrapped** (as accelerate's ``prepare`` does): the instance's ``step``
  runs the strategy's update and closes the iteration (``apply_update``,
  ``after_update``; for the other strategies ``after_backward`` first: the exchange);
  its ``zero_grad`` is the strategy's (which binds gradients to its slots). Calls the
  strategy makes itself (its update, a GradScaler's step, gpi's layer-wise step from a
  gradient hook: ``Strategy.busy``) reach the optimizer's own methods.
- **Checked**: a pattern that would skip communication or corrupt a shared buffer raises
  before it does (a second backward before the step, a step after ``no_sync()`` backward
  passes only, a step with no backward, a backward after a step without ``zero_grad``, an
  edit of the gradients a strategy cannot honour: ``grad_clip_reason``).
- **join()**: DDP's ``model.join()`` for uneven inputs. Inside it, each synchronous step
  starts with a one-float gloo allreduce of "still training" (1) over the job; a rank
  that left the block answers 0 and shadows every step the others still take (a step
  with no gradient: every strategy already treats a parameter backward did not reach
  as zero), so the mean is over the initial world size (DDP's default
  ``divide_by_initial_world_size=True``) and every rank keeps stepping on it: the
  weights stay equal. Once a round sums to 0, every rank has joined and all leave.
  Asynchronous strategies (``tolerates_peer_loss``) need no shadow: a rank that leaves
  marks itself done for TERM's policy (``strategies/elastic/termination.py``) and stops.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from shmtrain.strategies.base import Strategy
from shmtrain.strategies.nocomm import NoComm
from shmtrain.timing import PhaseTimer

FIX_STEP = "call optimizer.step() (or model.step()) once after every backward that is outside no_sync()"


class DDPStyle:
    """The DDP contract of one :class:`shmtrain.parallel.data_parallel.DataParallel` (module docstring).

    Args:
        strategy: the wrapper's strategy.
        optimizer: the optimizer it steps; its ``step`` and ``zero_grad`` are wrapped.
        timer: where the update phase goes.
    """

    def __init__(self, strategy: Strategy, optimizer: torch.optim.Optimizer, timer: PhaseTimer) -> None:
        self.strategy = strategy
        self.optimizer = optimizer
        self.timer = timer
        #: run ``after_backward`` when backward returns (the synchronous strategies)
        self.average_in_backward = type(strategy).synchronous
        #: >0 while this wrapper drives the strategy: optimizer calls are the strategy's own
        self.internal = 0
        self.closed = False
        #: what ran since the last step: None, "local" (no_sync() backward passes only) or
        #: "synced" (a backward outside no_sync())
        self.pending: str | None = None
        #: ``after_backward`` has run for the pending step (in the end-of-backward callback)
        self.reduced = False
        self.zeroed = True  # the strategies bind (or clear) their gradients when built
        self.joining = False  # inside join(): every synchronous step agrees first
        self._group: Any = None
        self._task = -2  # the autograd graph task last seen by the hook
        self._versions: list[int] | None = None
        self._original_step = optimizer.step
        self._original_zero_grad = optimizer.zero_grad
        step = _wrapped_step(self)
        step._shmtrain = True  # type: ignore[attr-defined]  # shmtrain's own (strategies/optim/partial_step.py)
        if hasattr(self._original_step, "_wrapped_by_lr_sched"):  # a scheduler made before: it
            step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # counts through the original
        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
        optimizer.zero_grad = types.MethodType(_wrapped_zero_grad(self), optimizer)  # type: ignore[method-assign]
        self._hooks = [p.register_hook(self._on_gradient) for p in strategy.params]

    # -- backward ---------------------------------------------------------------------
    def _on_gradient(self, grad: torch.Tensor) -> None:
        """A parameter's gradient is about to be accumulated: the first of a backward
        checks the pattern, agrees with the others under join(), and queues the end."""
        task = torch._C._current_graph_task_id()
        if task == self._task or self.closed:
            return
        self._task = task
        syncing = self.strategy.syncing
        if syncing and self.pending == "synced":
            raise RuntimeError("a second backward before optimizer.step(): the first one's gradients were "
                               "already exchanged (and this one would add into buffers other ranks read); "
                               f"{FIX_STEP}, with the optimizer given to DataParallel (another optimizer's "
                               "step is not the job's), or run the earlier micro-batches' backward inside "
                               "model.no_sync()")
        if not self.zeroed:
            raise RuntimeError("a backward after optimizer.step() with no zero_grad() since: the last step's "
                               "gradients may be views of shared memory the other ranks read; call "
                               "optimizer.zero_grad() (or model.zero_grad()) before every backward")
        if syncing and self.joining and self.strategy.synchronous:
            self._agree(training=True)
        self.pending = "synced" if syncing else (self.pending or "local")
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        """The autograd callback: average now (synchronous strategies, outside no_sync())."""
        if self.closed or not (self.average_in_backward and self.strategy.syncing):
            return
        strategy = self.strategy
        self._exchange()
        if strategy.shared_gradients and not strategy.staged:
            strategy.private_gradients(strategy.params)
        if strategy.grad_clip_reason:  # an edit of these gradients would come too late
            self._versions = [p.grad._version if p.grad is not None else -1 for p in strategy.params]

    # -- the step -------------------------------------------------------------------
    def user_step(self) -> None:
        """``optimizer.step()`` from the user's loop: the step after a synced backward."""
        if self.pending is None:
            raise RuntimeError("optimizer.step() with no backward since the last step: every step exchanges "
                               "the gradients of a backward on every rank; call loss.backward() first (a rank "
                               "out of batches: wrap the loop in `with model.join():`)")
        if self.pending == "local":
            raise RuntimeError("optimizer.step() after backward passes inside model.no_sync() only: their "
                               "gradients were never exchanged, so the ranks would drift apart; run the last "
                               "micro-batch's backward outside no_sync()")
        self.step()

    def step(self) -> None:
        """Communicate (unless done in backward), update the weights, close the iteration."""
        strategy = self.strategy
        if self.reduced:
            self._check_edits()
        try:
            with self._driving():
                if not self.reduced:
                    strategy.after_backward()
                with self.timer.phase("update"):
                    strategy.apply_update()
                strategy.after_update()
        finally:
            self.pending, self.reduced, self.zeroed, self._versions = None, False, False, None

    def _check_edits(self) -> None:
        versions = self._versions
        if versions is None:
            return
        now = [p.grad._version if p.grad is not None else -1 for p in self.strategy.params]
        if now != versions:
            self._versions = None
            strategy = type(self.strategy)
            raise RuntimeError(
                f"the gradients were changed between backward and optimizer.step() (e.g. clip_grad_norm_), "
                f"which {strategy.chosen_by(self.strategy.config)} cannot honour: {strategy.grad_clip_reason}; "
                "leave the gradients as backward left them, or use --strategy ssgd (ssgd --overlap also "
                "overlaps the exchange with backward)")

    def zero_grad(self) -> None:
        """The strategy's zero_grad (it binds the gradients to its buffers)."""
        with self._driving():
            self.strategy.zero_grad()
        self.zeroed = True

    # -- join -----------------------------------------------------------------------
    @contextlib.contextmanager
    def join(self) -> Iterator[None]:
        """DDP's ``model.join()`` (module docstring); every rank enters it."""
        strategy = self.strategy
        cls = type(strategy)
        if not cls.synchronous:
            if not (cls.tolerates_peer_loss or isinstance(strategy, NoComm)):
                raise ValueError(
                    f"join() with {cls.chosen_by(strategy.config)}: its exchanges need every worker in "
                    "every round, and it has no shadow step; give every rank the same number of batches, "
                    "or use a synchronous strategy (ssgd, gpi, cpu_acc, ps_grad) or an asynchronous one")
            yield
            termination = getattr(strategy, "termination", None)
            if termination is not None:  # TERM: this worker is done; the policy decides the others
                termination.mark_done(strategy.iteration)
            return
        if not self.average_in_backward:
            raise ValueError("join() needs the DDP-style steps (DataParallel(..., ddp_style=True), the default)")
        self.joining = True
        try:
            yield
            if self.pending is not None:
                raise RuntimeError(f"the loop inside join() ended with a backward not stepped; {FIX_STEP}")
            while self._agree(training=False):
                self._shadow_step()
        finally:
            self.joining = False

    def _agree(self, training: bool) -> bool:
        """One round of join()'s agreement: True while some rank still trains."""
        if dist.get_world_size() == 1:
            return training
        if self._group is None:
            self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        flag = torch.ones(1) if training else torch.zeros(1)
        dist.all_reduce(flag, group=self._group)
        return bool(flag.item() > 0)

    def _shadow_step(self) -> None:
        """A joined rank's part of a step the others take: no gradient of its own."""
        self.zero_grad()
        self._exchange()
        self.step()

    @contextlib.contextmanager
    def _driving(self) -> Iterator[None]:
        """The optimizer calls made inside are the strategy's own (its wrapped methods pass
        them to the optimizer's originals)."""
        self.internal += 1
        try:
            yield
        finally:
            self.internal -= 1

    def _exchange(self) -> None:
        """The strategy's exchange of this step's gradients (``after_backward``)."""
        with self._driving():
            self.strategy.after_backward()
        self.reduced = True

    def close(self) -> None:
        """Stop checking; the optimizer's own methods answer from now on."""
        self.closed = True
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def _wrapped_step(style: DDPStyle) -> Callable[..., Any]:
    def step(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if style.closed or style.internal or style.strategy.busy:
            return style._original_step(*args, **kwargs)
        if args or kwargs:
            raise ValueError("optimizer.step(closure) of a model wrapped in shmtrain.DataParallel: the step "
                             "exchanges the gradients of the backward before it, once; call "
                             "optimizer.step() with no closure")
        style.user_step()
        return None

    return step


def _wrapped_zero_grad(style: DDPStyle) -> Callable[..., Any]:
    def zero_grad(optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        if style.closed or style.internal or style.strategy.busy:
            style._original_zero_grad(set_to_none=set_to_none)
            return
        style.zero_grad()

    return zero_grad
