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

import dataclasses
from typing import Any

import torch
from torch import nn

from shmtrain import strategies
from shmtrain.fabric import context as fabric_context
from shmtrain.fabric.context import ProcessContext
from shmtrain.runtime.memory import keep_freed_memory
from shmtrain.strategies.base import StrategyConfig
from shmtrain.timing import PhaseTimer


def make_config(strategy: str, options: dict[str, Any]) -> StrategyConfig:
    """Build the strategy's typed Config from ``options``; reject options it does not take."""
    cls = strategies.get(strategy)
    known = {f.name for f in dataclasses.fields(cls.Config)}
    unknown = sorted(set(options) - known)
    if unknown:
        flags = ", ".join("--" + k.replace("_", "-") for k in unknown)
        takes = ", ".join("--" + k.replace("_", "-") for k in sorted(known)) or "no options"
        raise ValueError(f"{flags} does not apply to --strategy {strategy} (it takes {takes})")
    return cls.Config(**options)


class DataParallel(nn.Module):
    """Wrap ``module`` and ``optimizer`` so a plain PyTorch loop trains data-parallel.

    Args:
        module: the model (the same initial weights are taken from rank 0).
        optimizer: its optimizer (each worker keeps its own).
        strategy: a registered strategy name (``ssgd``, ``single``, ...).
        ctx: the process context; joined from the environment (torchrun) when omitted.
        timer: where phase times go (one per worker).
        **options: the strategy's Config fields.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        strategy: str = "ssgd",
        *,
        ctx: ProcessContext | None = None,
        timer: PhaseTimer | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        keep_freed_memory()  # no page-fault storm each iteration (shmtrain.runtime.memory)
        self.module = module
        self.optimizer = optimizer
        self._own_ctx = ctx is None
        self.ctx = ctx if ctx is not None else fabric_context.from_env()
        self.timer = timer or PhaseTimer()
        config = make_config(strategy, options)
        cls = strategies.get(strategy)
        if cls.world == "one" and self.ctx.world_size != 1:
            raise ValueError(
                f"--strategy {strategy} runs in one process, but the job has "
                f"{self.ctx.world_size}; use --workers 1 or another strategy"
            )
        self.strategy = cls(config, self.ctx, module, optimizer, self.timer)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.strategy.before_forward()
        return self.module(*args, **kwargs)

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

    def close(self) -> None:
        """End the strategy; leave the job if this wrapper joined it."""
        self.strategy.finish()
        if self._own_ctx:
            self.ctx.close()
