"""The Python API for one's own training loop, with DistributedDataParallel's contract.

Example (started by ``torchrun --nproc-per-node 2 script.py``; a DDP script converts by
changing its wrapper line only, docs/convert_ddp.md)::

    model = DataParallel(net, optimizer, strategy="ssgd")  # was: DistributedDataParallel(net)
    with model.join():  # uneven inputs: a rank out of batches shadows the others
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()  # synchronous strategies: p.grad is the job's mean here
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()  # the strategy's step (shmtrain/ddp_style.py)
    model.close()
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from torch import nn

from shmtrain import strategies
from shmtrain.fabric.job import context as fabric_context
from shmtrain.fabric.job.context import ProcessContext
from shmtrain.fabric.transports import Transports
from shmtrain.memory import keep_freed_memory
from shmtrain.parallel.ddp_style import DDPStyle
from shmtrain.strategies.base import StrategyConfig
from shmtrain.strategies.base import build_config as make_config
from shmtrain.strategies.plan import Plan
from shmtrain.strategies.plan import plan as make_plan
from shmtrain.timing import PhaseTimer

#: why the DDP-style loop steps the optimizer once, after backward (strategies/optim/partial_step.py)
DDP_STYLE_STEP = ("the DDP-style loop: the user's code may read or edit the gradients between backward and "
                  "optimizer.step()")


class DataParallel(nn.Module):
    """Wrap ``module`` and ``optimizer`` so a plain PyTorch (DDP) loop trains data-parallel.

    The loop is DDP's: ``optimizer.zero_grad()``, forward, ``loss.backward()``, optionally
    ``clip_grad_norm_``, ``optimizer.step()`` (the optimizer's ``step`` and ``zero_grad``
    are wrapped: :mod:`shmtrain.parallel.ddp_style`). With a synchronous strategy (ssgd and its
    variants, gpi, cpu_acc, ps_grad) the gradients are averaged when ``backward()``
    returns and ``optimizer.step()`` updates, so the weights equal DDP's; with the others
    (seasgd, easgd, hsgd, downpour, diloco, ps_weight, single) ``optimizer.step()`` runs
    the strategy's whole exchange and update. :meth:`step` (``model.step()``) does the
    same as ``optimizer.step()``: call one of the two after each backward, never both.
    Patterns that would skip communication raise with the fix; :meth:`no_sync`
    accumulates, :meth:`join` takes uneven inputs. What differs from DDP per strategy:
    docs/convert_ddp.md.

    Args:
        module: the model (the same initial weights are taken from rank 0).
        optimizer: its optimizer (each worker keeps its own).
        strategy: a registered strategy name (``ssgd``, ``single``, ...).
        config: the strategy's typed ``Config`` (built from ``options`` when omitted).
        ctx: the process context; joined from the environment (torchrun) when omitted,
            waiting for peers ``SHMTRAIN_TIMEOUT`` seconds (``shmtrain run --timeout``; 120).
        timer: where phase times go (one per worker).
        transports: where the strategy's transports come from (default: built from ``ctx``).
        device: move ``module`` there first (``"cuda"``, ``"cuda:1"``, ``"cpu"``); by
            default the device is the one its parameters are on. On a GPU the strategy's
            buffers stay in host memory and its copies are staged (``strategies/layout/staging.py``).
        grad_clip: clip the global L2 norm of the gradient the optimizer steps with (the
            averaged one, for synchronous strategies) to this, before every step
            (``--grad-clip``; refused by the strategies that cannot, with the reason).
        ddp_style: wrap the optimizer and average in backward (default); False keeps
            ``model.step()`` as the only step, communicating there (``shmtrain train``'s
            :class:`~shmtrain.runtime.train.trainer.Trainer` sets it, see :attr:`ddp_style`).
            Without it, ``ssgd --overlap`` on a GPU may step a bucket's parameters during
            backward, as soon as its mean is back (``strategies/optim/partial_step.py``): read the
            weights before backward or after ``model.step()``, not between.
        plan: the strategy already checked for this job (:func:`shmtrain.strategies.plan.plan`,
            ``shmtrain train``'s configuration carries one): used when it was made for
            ``config`` and a job of this shape, so nothing is checked twice; else one is made.
        **options: the strategy's Config fields (when ``config`` is not given).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        strategy: str = "ssgd",
        *,
        config: StrategyConfig | None = None,
        ctx: ProcessContext | None = None,
        timer: PhaseTimer | None = None,
        transports: Transports | None = None,
        device: torch.device | str | None = None,
        grad_clip: float | None = None,
        ddp_style: bool = True,
        plan: Plan | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        keep_freed_memory()  # no page-fault storm each iteration (shmtrain.memory)
        if device is not None:
            module.to(device)  # in place: the optimizer keeps the same Parameter objects
        self.module = module
        self.optimizer = optimizer
        strategies.get(strategy)  # an unknown name fails before the job is joined
        if config is None:
            config = make_config(strategy, options)
        elif options:
            raise ValueError(f"give the options of --strategy {strategy} either as config= or "
                             f"as keywords, not both ({', '.join(sorted(options))})")
        self._own_ctx = ctx is None
        # shmtrain run --timeout reaches its workers as SHMTRAIN_TIMEOUT: the waits for peers follow it
        timeout = float(os.environ.get("SHMTRAIN_TIMEOUT", fabric_context.DEFAULT_TIMEOUT_S))
        self.ctx = ctx if ctx is not None else fabric_context.from_env(timeout)
        self.timer = timer or PhaseTimer()
        if grad_clip is not None and not grad_clip > 0:
            raise ValueError(f"grad_clip={grad_clip!r}: the norm to clip to must be positive; use e.g. 1.0, or None")
        control = self._control()
        if control is not None:  # a new training: earlier "finished" marks count for nothing
            control.generation += 1
            control.steps_done = lambda: getattr(getattr(self, "strategy", None), "iteration", 0)
        try:
            if plan is None or plan.config is not config or not plan.fits(self.ctx.world_size, self.ctx.num_nodes):
                plan = make_plan(strategy, config, self.ctx.world_size, self.ctx.num_nodes,
                                 optimizer=type(optimizer).__name__, grad_clip=grad_clip)
        except ValueError:
            if self._own_ctx:
                self.ctx.close()
            raise
        self.strategy = plan.build(self.ctx, module, optimizer, self.timer, transports=transports)
        self.strategy.grad_clip = grad_clip
        self._ddp: DDPStyle | None = None
        self.ddp_style = ddp_style

    @property
    def ddp_style(self) -> bool:
        """Whether the loop is DDP's (``optimizer.step()``, averaged in backward, checked);
        False: ``model.step()`` does all the communication, as :class:`Trainer` wants (its
        phases time backward and comm apart, and ``--sub-batch`` delivers gradients through
        one backward per parameter). Set it before the first backward."""
        return self._ddp is not None

    @ddp_style.setter
    def ddp_style(self, value: bool) -> None:
        if value and self._ddp is None:
            self._ddp = DDPStyle(self.strategy, self.optimizer, self.timer)
        elif not value and self._ddp is not None:
            self._ddp.close()
            self._ddp = None
        # the user's code may read or edit the gradients between backward and optimizer.step()
        self.strategy.whole_step_reason = DDP_STYLE_STEP if value else None

    def _control(self) -> Any:
        return getattr(getattr(self.ctx, "host", None), "control", None)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.before_forward()
        return self.module(*args, **kwargs)

    def before_forward(self) -> None:
        """The strategy's work before a forward pass; ``forward`` calls it, and so does a
        caller that runs ``module`` itself (``runtime/train/subbatch.py``: K threads, one call)."""
        self.strategy.before_forward()

    def attach_scaler(self, scaler: Any) -> None:
        """Step the optimizer through a ``torch.amp.GradScaler`` (``--amp fp16``); the
        caller scales the loss and calls ``scaler.update()`` after :meth:`step`."""
        self.strategy.attach_scaler(scaler)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside accumulate gradients and start no exchange, as DDP's
        ``no_sync``; the first backward after it communicates their sum."""
        return self.strategy.no_sync()

    def join(self) -> contextlib.AbstractContextManager[None]:
        """DDP's ``model.join()`` for uneven inputs; every rank wraps its loop in it.

        Synchronous strategies: a rank that leaves the block shadows every step the others
        still take (no gradient of its own; the mean is over the initial world size, as
        DDP's default ``divide_by_initial_world_size=True``) until every rank has left;
        all ranks keep stepping, so their weights stay equal. Asynchronous strategies: a
        rank that leaves is done (TERM's policy, ``--terminate``, decides for the others);
        ps_weight, diloco and hsgd refuse it (their rounds need every worker)."""
        if self._ddp is None:
            raise ValueError("join() needs the DDP-style loop; leave ddp_style=True (the default)")
        return self._ddp.join()

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002 - strategy decides
        """The strategy's zero_grad (``optimizer.zero_grad()`` is the same)."""
        if self._ddp is not None:
            self._ddp.zero_grad()
        else:
            self.strategy.zero_grad()

    def step(self) -> None:
        """Finish the iteration: communicate (unless backward did), update the weights,
        close the step. The same as ``optimizer.step()``, without its checks: one of the
        two after every backward."""
        if self._ddp is not None:
            self._ddp.step()
            return
        self.strategy.after_backward()
        with self.timer.phase("update"):
            self.strategy.apply_update()
        self.strategy.after_update()

    def should_stop(self) -> bool:
        return self.strategy.should_stop()

    @property
    def iteration(self) -> int:
        """Iterations of the run so far (restored with a checkpoint)."""
        return self.strategy.iteration

    @property
    def target_iterations(self) -> int | None:
        """Iterations this worker is asked to run (None: no limit); asynchronous
        strategies align their ends around it (TERM)."""
        return self.strategy.target_iterations

    @target_iterations.setter
    def target_iterations(self, value: int | None) -> None:
        self.strategy.target_iterations = value

    @property
    def lost_peers(self) -> dict[int, int]:
        """Peers lost during the run (rank -> iterations they had published), for the
        strategies that train on without them."""
        return dict(self.strategy.lost_peers)

    def lost_now(self) -> set[int]:
        """The ranks known lost now (asynchronous strategies train on without them)."""
        return self.strategy.lost_now()

    def global_state_dict(self) -> dict[str, torch.Tensor] | None:
        """After :meth:`close`, on the worker that held them: the module's state with its
        parameters replaced by the job's global weights (W_g, the centre variable the
        asynchronous methods converge to; the buffers, e.g. batch-norm statistics, are this
        worker's). None for strategies whose workers' weights are the job's model."""
        flat = self.strategy.final_global_weights
        if flat is None:
            return None
        state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        names = {id(p): n for n, p in self.module.named_parameters()}
        for param, view in zip(self.strategy.layout.params, self.strategy.layout.views(flat), strict=True):
            state[names[id(param)]] = view.clone().to(param.device)
        return state

    def close(self) -> None:
        """End the strategy; leave the job if this wrapper joined it, leaving a process
        group the script created itself (its ``dist.destroy_process_group()`` ends it).
        This rank is marked finished: a peer still stepping is told "finished after N
        steps" (the fix: :meth:`join`), not that it died."""
        control = self._control()
        if control is not None:
            # the exchanges of the steps taken (one still in flight on a helper thread) are
            # posted before the mark: a peer waiting for one must not read "finished" first.
            # A failure here is sticky, and finish() below reports it.
            with contextlib.suppress(Exception):
                self.strategy.quiesce()
            control.set_finished(self.ctx.local_rank, self.strategy.iteration)
        self.ddp_style = False
        self.strategy.finish()
        if self._own_ctx:
            self.ctx.close()
