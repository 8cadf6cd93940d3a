"""``ssgd --allreduce nccl``: the gradients averaged by NCCL on the GPUs, the DDP baseline.

Issue 14 item 3. This is what PyTorch DDP does on GPUs (one GPU per worker, gradients
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

import socket

import torch
import torch.distributed as dist

from shmtrain.fabric.flat import FlatLayout, broadcast_parameters
from shmtrain.strategies.base import Strategy


def gpu_identity(device: torch.device) -> str:
    """``host/GPU-UUID`` of ``device``: equal for two workers on the same GPU."""
    return f"{socket.gethostname()}/{torch.cuda.get_device_properties(device).uuid}"


def check_distinct_gpus(identities: list[str]) -> None:
    """Refuse workers that share a GPU (``identities`` by rank, from :func:`gpu_identity`)."""
    seen: dict[str, list[int]] = {}
    for rank, ident in enumerate(identities):
        seen.setdefault(ident, []).append(rank)
    shared = [ranks for ranks in seen.values() if len(ranks) > 1]
    if shared:
        ranks = shared[0]
        raise ValueError(
            f"--allreduce nccl needs one GPU per worker, but ranks {', '.join(map(str, ranks))} share "
            f"GPU {identities[ranks[0]].split('/', 1)[1]} on host {identities[ranks[0]].split('/', 1)[0]} "
            "(NCCL cannot run two ranks on one GPU); run at most one worker per GPU (--workers = the "
            "GPUs per host, --device cuda), or use --allreduce shm, which stages through host memory "
            "and lets workers share a GPU")


class NcclSSGD(Strategy):
    """Synchronous SGD, gradients averaged by NCCL (not registered: ``ssgd`` hands a config
    with ``allreduce="nccl"`` to it, see ``SSGD.implementation``)."""

    name = "ssgd"
    devices = frozenset({"cuda"})
    allreduces = ("nccl",)
    device_rule = "reduces GPU tensors"
    device_fix = ("use --device cuda (one GPU per worker), or another --allreduce (shm stages GPU "
                  "gradients through host memory and also runs on the CPU)")
    variant_reason = "the NCCL baseline is one allreduce of the float32 gradients after backward, as DDP's"

    @classmethod
    def check_device(cls, params: list[torch.Tensor]) -> None:
        found = sorted({p.device.type for p in params} - cls.devices)
        if found:
            raise ValueError(
                f"--allreduce nccl reduces GPU tensors, but the model is on {found[0]}; use "
                "--device cuda, or another --allreduce (shm, the default, runs on the CPU and "
                "stages GPU gradients through host memory)")

    def __init__(self, config, ctx, model, optimizer, timer=None, *, transports=None) -> None:
        super().__init__(config, ctx, model, optimizer, timer, transports=transports)
        identities: list[str] = [""] * ctx.world_size
        dist.all_gather_object(identities, gpu_identity(self.device))
        check_distinct_gpus(identities)
        torch.cuda.set_device(self.device)
        self.group = dist.new_group(backend="nccl")
        self.layout = layout = FlatLayout(self.params)
        broadcast_parameters(layout)
        self.flat = torch.zeros(layout.numel, dtype=layout.dtype, device=self.device)
        self._views = layout.views(self.flat)
        self.zero_grad()

    def zero_grad(self) -> None:
        self.flat.zero_()
        self.layout.bind_grads(self._views)

    def after_backward(self) -> None:
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record()
        dist.all_reduce(self.flat, op=dist.ReduceOp.AVG, group=self.group)
        end.record()
        end.synchronize()  # the host's view of the step: the mean is in place
        self.timer.add("comm", begin.elapsed_time(end) / 1e3)

    def finish(self) -> None:
        try:
            dist.destroy_process_group(self.group)
        finally:
            super().finish()
