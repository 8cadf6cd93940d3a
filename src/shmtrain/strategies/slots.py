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
    item 4): ``param.grad`` cannot be views of a bfloat16 slot (autograd writes the
    parameters' dtype), so they are views of one private float32 flat buffer instead; after
    backward that buffer is cast into this worker's slot in one pass, and the mean is cast
    back into it in one more. The slots and the bytes between hosts are halved; the
    optimizer and the weights stay float32."""

    def bind_slots(self) -> None:
        self._flat = torch.empty(self.layout.numel, dtype=self.layout.dtype)
        self._flat_views = self.layout.views(self._flat)
        self.zero_grad()

    def zero_grad(self) -> None:
        self._flat.zero_()
        self.layout.bind_grads(self._flat_views)

    def after_backward(self) -> None:
        with self.timer.phase("comm"):
            self.allreduce.input(self.allreduce.count + 1).copy_(self._flat)
            self.allreduce()
            self._flat.copy_(self.allreduce.result(self.allreduce.count))
