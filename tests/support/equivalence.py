"""A strategy against single-process SGD on the union batch, after every step: the
worker that trains :class:`Mixed` with a strategy of :data:`STRATEGIES` (rank 0 also runs
the reference and measures the error), launched as
``"support.equivalence:equivalence_worker"`` by the overlap, staged and CUDA tests."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
from torch import nn

from shmtrain.parallel.data_parallel import DataParallel
from shmtrain.strategies.layout.staging import STAGING_ENV
from shmtrain.timing import PhaseTimer

#: name -> (strategy, options) of the runs the tests launch by name
STRATEGIES = {
    "gpi": ("gpi", {}),
    "cpu_acc": ("cpu_acc", {}),
    # 0.1 MiB buckets: the 590 kB layer alone, the small ones grouped (several buckets)
    "ssgd_overlap": ("ssgd", {"overlap": True, "bucket_mb": 0.1}),
    "ssgd_overlap_gloo": ("ssgd", {"overlap": True, "bucket_mb": 0.1, "allreduce": "gloo"}),
    "ssgd": ("ssgd", {}),
    "ssgd_ring": ("ssgd", {"allreduce": "ring"}),
    "ps_grad": ("ps_grad", {}),
    "ps_weight": ("ps_weight", {}),
    "ssgd_nccl": ("ssgd", {"allreduce": "nccl"}),  # GPUs only (tests/gpu/test_cuda.py)
    # not plain SGD: tests/strategies/layout/test_staged.py compares them staged against unstaged
    "ssgd_bf16": ("ssgd", {"comm_dtype": "bf16"}),
    "easgd": ("easgd", {}),
    "downpour": ("downpour", {}),
    "seasgd": ("seasgd", {}),
    "hsgd": ("hsgd", {"groups": 1}),
}


class Mixed(nn.Module):
    """Layers of very different sizes: 1, 4, 5, 108, 1024, 5120 and 147456 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.wide = nn.Linear(4 * 6 * 6, 1024)
        self.head = nn.Linear(1024, 5)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.wide(torch.relu(self.conv(x)).flatten(1)))
        return self.head(hidden) * self.scale


def relative_errors(model: nn.Module, reference: nn.Module) -> dict[str, float]:
    """``||w - w_ref|| / ||w_ref||`` of the whole model and of each parameter; a
    parameter's denominator is floored at 0.1 so a weight passing near zero (a bias) does
    not turn round-off into a large ratio, while a missing contribution still shows."""
    errors, diff, norm = {}, 0.0, 0.0
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        d, n = float((p.detach() - q.detach()).norm()), float(q.detach().norm())
        errors[name] = d / max(n, 0.1)
        diff, norm = diff + d * d, norm + n * n
    errors["model"] = (diff / norm) ** 0.5
    return errors


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer of every run and of the reference: SGD, lr 0.05, momentum 0.9, weight decay 1e-4."""
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)


def equivalence_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    """Train with the strategy; rank 0 also runs single-process SGD on the union batch and
    measures the error after every step; every rank returns a digest of its weights per
    step (all ranks must hold the same bits)."""
    strategy, options = STRATEGIES[payload["mode"]]
    world, batch = ctx.world_size, payload["batch"]
    device = torch.device(payload.get("device", "cpu"))
    if device.type == "cuda" and device.index is None:  # one GPU per local rank, as --device cuda
        device = torch.device("cuda", ctx.local_rank % torch.cuda.device_count())
    if payload.get("staged"):  # the GPU data flow on the CPU: real copies to the host buffers
        os.environ[STAGING_ENV] = "copy"
    if device.type == "cuda":  # float32 everywhere (no TF32), the same kernels every step
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.manual_seed(0)
    model = Mixed().to(device)
    reference = Mixed().to(device)
    reference.load_state_dict(model.state_dict())
    opt, ref_opt = sgd(model), sgd(reference)
    timer = PhaseTimer()
    # the strategy's own path, as shmtrain train's Trainer drives it (zero copy: gradients in the
    # shared slots); tests/parallel/test_ddp_style.py covers the DDP-style loop
    dp = DataParallel(model, opt, strategy, ctx=ctx, timer=timer, ddp_style=False, **options)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(1)
    errors, digests, rows = [], [], []
    for _ in range(payload["steps"]):
        x = torch.randn((world * batch, 3, 8, 8), generator=gen).to(device)
        y = torch.randint(0, 5, (world * batch,), generator=gen).to(device)
        mine = slice(ctx.rank * batch, (ctx.rank + 1) * batch)
        dp.zero_grad()
        loss_fn(dp(x[mine]), y[mine]).backward()
        dp.step()
        rows.append({"time": timer.finish_iteration(), **timer.take_details()})
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
        digests.append(hashlib.sha1(flat.numpy().tobytes()).hexdigest())
        if ctx.rank == 0:
            ref_opt.zero_grad()
            loss_fn(reference(x), y).backward()
            ref_opt.step()
            errors.append(relative_errors(model, reference))
    staged = dp.strategy.staged
    shared = [t.data_ptr() for p in model.parameters() for t in (p.data, p.grad)
              if t is not None and t.device.type == "cpu" and in_shared_memory(t.data_ptr())]
    dp.close()
    return {"errors": errors, "digests": digests, "last": rows[-1], "staged": staged, "shared": len(shared)}


def in_shared_memory(address: int) -> bool:
    """Whether ``address`` lies in a mapping of a /dev/shm segment of this process."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            if lo <= address < hi:
                return len(fields) > 5 and "/dev/shm/" in fields[5]
    return False

