"""``ssgd --allreduce nccl``: the gradients averaged by NCCL on the GPUs, the DDP baseline.

This is what PyTorch DDP does on GPUs (one GPU per worker, gradients
allreduced device to device by NCCL), run with ``ssgd``'s semantics so that the papers'
host-staged path (``--allreduce shm``: gradients copied to host shared memory, reduced
there, copied back; ShmCaffe, CaffeGPI and TRL keep their buffers in host memory) and
NCCL can be compared in one command. ``param.grad`` are views of one flat device buffer
(PACK, swCaffe Section V-A); after backward one ``all_reduce(AVG)`` on a NCCL group
averages it in place, and every worker applies the same step.

NCCL cannot run two ranks on one GPU: the constructor gathers every rank's (host, GPU
UUID) over gloo and refuses a job whose workers share a GPU, naming them. The ``comm``
phase is the allreduce's time on the GPU (CUDA events around it on the current stream).
"""

from __future__ import annotations

import torch

from shmtrain.fabric.exchanges.weights import broadcast_parameters
from shmtrain.strategies.base import Strategy
from shmtrain.strategies.layout.flat import FlatLayout


class NcclSSGD(Strategy):
    """Synchronous SGD, gradients averaged by NCCL (not registered: ``ssgd`` hands a config
    with ``allreduce="nccl"`` to it, see ``SSGD.implementation``)."""

    name = "ssgd"
    synchronous = True
    devices = frozenset({"cuda"})
    allreduces = ("nccl",)
    device_rule = "reduces GPU tensors"
    device_fix = ("use --device cuda (one GPU per worker), or another --allreduce (shm stages GPU "
                  "gradients through host memory and also runs on the CPU)")
    variant_reason = "the NCCL baseline is one allreduce of the float32 gradients after backward, as DDP's"

    @classmethod
    def device_refusal(cls, found: list[str]) -> str:
        return (
            f"--allreduce nccl reduces GPU tensors, but the model is on {found[0]}; use "
            "--device cuda, or another --allreduce (shm, the default, runs on the CPU and "
            "stages GPU gradients through host memory)")

    def __init__(self, config, ctx, model, optimizer, timer=None, *, transports=None) -> None:
        super().__init__(config, ctx, model, optimizer, timer, transports=transports)
        self.group = self.transports.nccl_group(self.device)
        self.layout = layout = FlatLayout(self.params)
        broadcast_parameters(layout)
        self.flat = torch.zeros(layout.numel, dtype=layout.dtype, device=self.device)
        self._views = layout.views(self.flat)
        self.zero_grad()

    def zero_grad(self) -> None:
        self.flat.zero_()
        self.layout.bind_grads(self._views)

    def after_backward(self) -> None:
        self.timer.add("comm", self.group.mean_(self.flat))

    def finish(self) -> None:
        try:
            self.group.close()
        finally:
            super().finish()
