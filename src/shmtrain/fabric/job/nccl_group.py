"""NCCL among the job's workers, one GPU each: the DDP baseline's transport.

``ssgd --allreduce nccl`` averages its flat gradient with one NCCL allreduce per step,
as DDP does. NCCL cannot run two ranks on one GPU, so the group is refused, naming the
ranks and the GPU, when workers share one. Built by
:meth:`shmtrain.fabric.transports.Transports.nccl_group`.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist


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


class NcclGroup:
    """A NCCL process group over every worker of the job (collective to build)."""

    def __init__(self, device: torch.device, world_size: int) -> None:
        identities: list[str] = [""] * world_size
        dist.all_gather_object(identities, gpu_identity(device))
        check_distinct_gpus(identities)
        torch.cuda.set_device(device)
        self.group = dist.new_group(backend="nccl")

    def mean_(self, tensor: torch.Tensor) -> float:
        """Average ``tensor`` over the group in place; the seconds it took on the GPU
        (CUDA events), after which the mean is in place."""
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record()
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=self.group)
        end.record()
        end.synchronize()  # the host's view of the step: the mean is in place
        return begin.elapsed_time(end) / 1e3

    def close(self) -> None:
        dist.destroy_process_group(self.group)
