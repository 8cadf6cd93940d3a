"""Whether an optimizer's step writes into the gradients it reads.

The zero-copy strategies hand the optimizer gradients that are views of shared memory
other workers read at the same time (ssgd's and hsgd's result slots, cpu_acc's sums;
gpi's root steps with its own private gradients, through its own layer-wise step).
An optimizer that writes its gradient in place would change what the others read. The
classes of :data:`READ_ONLY` never do, checked on the installed torch by
``tests/runtime/train/test_optimizers.py``. The one exception is SGD with Nesterov momentum and no
weight decay: its foreach path adds the momentum into the gradient. Any other optimizer,
including a subclass that may override ``step``, is treated as a writer, and
:meth:`shmtrain.strategies.base.Strategy.step_optimizer` gives it private copies first.
"""

from __future__ import annotations

import torch

#: torch.optim classes whose ``step`` only reads ``param.grad`` (SGD: see :func:`writes_gradients`)
READ_ONLY: frozenset[type[torch.optim.Optimizer]] = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta, torch.optim.ASGD,
    torch.optim.Rprop,
})


def writes_gradients(optimizer: torch.optim.Optimizer) -> bool:
    """True unless ``optimizer``'s step is known to leave every ``param.grad`` as it was."""
    if type(optimizer) not in READ_ONLY:
        return True
    if type(optimizer) is torch.optim.SGD:  # foreach Nesterov: grad += momentum * buf, in place
        return any(g["nesterov"] and g["momentum"] and not g["weight_decay"] for g in optimizer.param_groups)
    return False
