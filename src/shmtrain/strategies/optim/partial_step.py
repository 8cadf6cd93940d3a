"""One optimizer, stepped over part of the parameters at a time (``ssgd --overlap``'s
per-bucket step).

A staged ``ssgd --overlap`` copies each bucket's mean gradient back to the device while
backward goes on (docs/gpu.md); the parameters of that bucket can then be stepped at once,
before the other buckets' means have landed. PyTorch DDP does the same through a comm
hook that runs a functional optimizer on each bucket once its allreduce completes
(``ddp_comm_hooks/optimizer_overlap_hooks.py``); here the user's own optimizer object
steps, restricted to a bucket: :func:`step_part` runs its class's ``step`` on a view of
it whose ``param_groups`` are copies of the groups that list only the bucket's
parameters. The optimizer's ``state`` (keyed by parameter) and its ``state_dict``
layout are those of the one optimizer, so checkpoints are unchanged.

That equals one step after backward only for an optimizer whose update of a parameter
reads nothing but that parameter, its gradient, its own state and its group's
hyper-parameters: every class of :data:`PER_PARAMETER` (checked on the installed torch
by ``tests/strategies/test_bucket_step.py``, bit for bit). Every other case keeps the one step
after backward, and :func:`whole_step_reason` names why:

- an optimizer class not in the list (a subclass too: it may override ``step``), a group
  with ``differentiable`` set, step hooks (they would run once per bucket), or a ``step``
  replaced on the instance by anyone but a scheduler or shmtrain (it would be bypassed);
- ``--grad-clip``: the clipping coefficient is the global norm of every gradient;
- ``--amp fp16``: the GradScaler unscales and checks every gradient for inf/NaN, and
  skips the whole step when one has any;
- the loop's own terms (:attr:`shmtrain.strategies.base.Strategy.whole_step_reason`):
  the DDP-style loop (the user's code may read or clip the gradients between backward
  and ``optimizer.step()``), ``--sub-batch`` (its threads run copies of the model).

A learning-rate scheduler and ``--accumulate`` keep the per-bucket step: the scheduler
steps after the iteration's last step, so every bucket of an iteration steps with the
same learning rate; the micro-batches before the last run in ``no_sync()`` (no hook
fires), and the last one's hooks see the whole batch's gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

#: optimizer classes whose update of a parameter reads only that parameter, its gradient,
#: its own state and its group's hyper-parameters (exact classes: a subclass is not known)
PER_PARAMETER: frozenset[type[torch.optim.Optimizer]] = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta, torch.optim.ASGD,
    torch.optim.Rprop,
})


def whole_step_reason(strategy: Any) -> str | None:
    """Why ``strategy``'s optimizer must step once, after backward; None when it may step
    each bucket's parameters as their mean lands (see the module docstring)."""
    if strategy.whole_step_reason:
        return strategy.whole_step_reason
    if strategy.grad_clip is not None:
        return f"--grad-clip {strategy.grad_clip}: the clipping coefficient is the global norm of every gradient"
    if strategy.scaler is not None:
        return ("--amp fp16: the GradScaler unscales and checks every gradient for inf/NaN before the step "
                "(and skips the whole step when one has any)")
    return optimizer_reason(strategy.optimizer)


def optimizer_reason(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` cannot step part of its parameters at a time; None when it can."""
    name = type(optimizer).__name__
    if type(optimizer) not in PER_PARAMETER:
        return (f"optimizer {name} is not known to update each parameter from its own gradient and state "
                f"alone (known: {', '.join(sorted(c.__name__ for c in PER_PARAMETER))})")
    if any(group.get("differentiable") for group in optimizer.param_groups):
        return f"optimizer {name} with differentiable=True"
    step = optimizer.__dict__.get("step")  # a wrapper set on the instance (the class's step runs)
    if step is not None and not (getattr(step, "_wrapped_by_lr_sched", False) or getattr(step, "_shmtrain", False)):
        return f"optimizer {name} has its step replaced on the instance (the per-bucket step would bypass it)"
    if (optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
            or _global_optimizer_pre_hooks or _global_optimizer_post_hooks):
        return f"optimizer {name} has step hooks (they would run once per bucket)"
    return None


def split_groups(optimizer: torch.optim.Optimizer, part_of: dict[int, int], parts: int
                 ) -> list[list[dict[str, Any]]]:
    """Per part, copies of ``optimizer``'s param groups that list only the parameters of
    that part (``part_of``: ``id(param)`` -> part; parameters in no part are left out),
    each group's hyper-parameters as they are now. A group with none of a part's
    parameters is left out of that part."""
    split: list[list[dict[str, Any]]] = [[] for _ in range(parts)]
    for group in optimizer.param_groups:
        lists: list[list[torch.Tensor]] = [[] for _ in range(parts)]
        for p in group["params"]:
            part = part_of.get(id(p))
            if part is not None:
                lists[part].append(p)
        for part, params in enumerate(lists):
            if params:
                split[part].append({**group, "params": params})
    return split


def step_part(optimizer: torch.optim.Optimizer, groups: Sequence[dict[str, Any]]) -> None:
    """``optimizer.step()`` over the parameters of ``groups`` only (from
    :func:`split_groups`): the same state, the other parameters untouched.

    The class's ``step`` runs on a view of ``optimizer`` (its attributes, the same
    ``state``; only ``param_groups`` differs), so a thread that reads
    ``optimizer.param_groups`` meanwhile (the loop logging the learning rate) sees the
    whole groups. A learning-rate scheduler learns of the step as from ``optimizer.step()``."""
    if not groups:
        return
    view = object.__new__(type(optimizer))
    view.__dict__.update(optimizer.__dict__)
    view.param_groups = list(groups)
    type(optimizer).step(view)
    if getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        optimizer._opt_called = True  # what the scheduler's wrapper of step records
