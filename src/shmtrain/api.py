"""The Python API for one's own training loop, in the spirit of DistributedDataParallel.

Example (started by ``torchrun --nproc-per-node 2 script.py``)::

    model = DataParallel(net, optimizer, strategy="ssgd")
    for x, y in loader:
        model.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        model.step()
    model.close()
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from shmtrain import strategies
from shmtrain.fabric import context as fabric_context
from shmtrain.fabric.context import ProcessContext
from shmtrain.fabric.transports import Transports
from shmtrain.memory import keep_freed_memory
from shmtrain.strategies.base import StrategyConfig, plan
from shmtrain.strategies.base import build_config as make_config
from shmtrain.timing import PhaseTimer


class DataParallel(nn.Module):
    """Wrap ``module`` and ``optimizer`` so a plain PyTorch loop trains data-parallel.

    Args:
        module: the model (the same initial weights are taken from rank 0).
        optimizer: its optimizer (each worker keeps its own).
        strategy: a registered strategy name (``ssgd``, ``single``, ...).
        config: the strategy's typed ``Config`` (built from ``options`` when omitted).
        ctx: the process context; joined from the environment (torchrun) when omitted.
        timer: where phase times go (one per worker).
        transports: where the strategy's transports come from (default: built from ``ctx``).
        device: move ``module`` there first (``"cuda"``, ``"cuda:1"``, ``"cpu"``); by
            default the device is the one its parameters are on. On a GPU the strategy's
            buffers stay in host memory and its copies are staged (``fabric/staging.py``).
        grad_clip: clip the global L2 norm of the gradient the optimizer steps with (the
            averaged one, for synchronous strategies) to this, before every step
            (``--grad-clip``; refused by the strategies that cannot, with the reason).
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
        self.ctx = ctx if ctx is not None else fabric_context.from_env()
        self.timer = timer or PhaseTimer()
        if grad_clip is not None and not grad_clip > 0:
            raise ValueError(f"grad_clip={grad_clip!r}: the norm to clip to must be positive; use e.g. 1.0, or None")
        try:
            impl = plan(strategy, config, self.ctx.world_size, self.ctx.num_nodes)
            impl.check_optimizer(type(optimizer).__name__, strategies.get(strategy).chosen_by(config), grad_clip=grad_clip)
        except ValueError:
            if self._own_ctx:
                self.ctx.close()
            raise
        self.strategy = impl(config, self.ctx, module, optimizer, self.timer, transports=transports)
        self.strategy.grad_clip = grad_clip

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.before_forward()
        return self.module(*args, **kwargs)

    def before_forward(self) -> None:
        """The strategy's work before a forward pass; ``forward`` calls it, and so does a
        caller that runs ``module`` itself (``runtime/subbatch.py``: K threads, one call)."""
        self.strategy.before_forward()

    def attach_scaler(self, scaler: Any) -> None:
        """Step the optimizer through a ``torch.amp.GradScaler`` (``--amp fp16``); the
        caller scales the loss and calls ``scaler.update()`` after :meth:`step`."""
        self.strategy.attach_scaler(scaler)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside accumulate gradients and start no exchange, as DDP's
        ``no_sync``; the first backward after it communicates their sum."""
        return self.strategy.no_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002 - strategy decides
        self.strategy.zero_grad()

    def step(self) -> None:
        """Finish the iteration: communicate, update the weights, close the step."""
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
        """End the strategy; leave the job if this wrapper joined it."""
        self.strategy.finish()
        if self._own_ctx:
            self.ctx.close()
