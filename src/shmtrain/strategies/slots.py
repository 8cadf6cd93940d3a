"""Gradients that live in the allreduce's own slots: the part of synchronous SGD that
``ssgd`` and ``ssgd --sharded-update`` share.

Zero copy in: before backward, ``param.grad`` are views of this worker's (zeroed) input
slot, so autograd writes the gradients straight into shared memory. Zero copy out: after
the allreduce, ``param.grad`` are re-pointed at the result, which the optimizer reads
in place. Both slot sets alternate by step parity (``shm_allreduce.py``), and the views
of both are made once, so binding is pointer work.
"""

from __future__ import annotations

from typing import Any

import torch

from shmtrain.fabric.flat import FlatLayout
from shmtrain.timing import PhaseTimer


class SlotGradients:
    """Mixin for a Strategy with ``layout`` (FlatLayout), ``allreduce`` (with ``input``,
    ``result``, ``count`` and a call that reduces) and ``timer``."""

    layout: FlatLayout
    allreduce: Any
    timer: PhaseTimer

    def bind_slots(self) -> None:
        """Make the views of both slot sets and both results, and zero the first input."""
        self._input_views = [self.layout.views(self.allreduce.input(s)) for s in (0, 1)]
        self._result_views = [self.layout.views(self.allreduce.result(s)) for s in (0, 1)]
        self.zero_grad()

    def zero_grad(self) -> None:
        step = self.allreduce.count + 1
        self.allreduce.input(step).zero_()
        self.layout.bind_grads(self._input_views[step % 2])

    def after_backward(self) -> None:
        with self.timer.phase("comm"):
            self.allreduce()
        self.layout.bind_grads(self._result_views[self.allreduce.count % 2])


class CastSlotGradients(SlotGradients):
    """The same, through an allreduce of a narrower dtype (``--comm-dtype bf16``, issue 14
    item 4): the gradients stay private float32 tensors (autograd needs the parameters'
    dtype), are cast into this worker's slot after backward and the mean is cast back, so
    the slots and the bytes between hosts are halved for two passes of copies; the
    optimizer and the weights stay float32."""

    params: list[torch.Tensor]
    optimizer: Any

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def after_backward(self) -> None:
        with self.timer.phase("comm"):
            step = self.allreduce.count + 1
            for view, p in zip(self._input_views[step % 2], self.params, strict=True):
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
            self.allreduce()
            for view, p in zip(self._result_views[self.allreduce.count % 2], self.params, strict=True):
                if p.grad is None:
                    p.grad = view.to(p.dtype)
                else:
                    p.grad.copy_(view)
