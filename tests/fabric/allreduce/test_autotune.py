"""SSGD over the schedule allreduces and ``--allreduce auto`` (AUTOTUNE), against
single-process SGD on the union of the workers' batches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shmtrain.fabric.allreduce.collectives import build_allreduce
from shmtrain.parallel.data_parallel import DataParallel
from shmtrain.runtime.launch.launcher import launch

BATCH = 4
STEPS = 13  # auto: 5 candidates x 2 trials = 10 tuning steps, then 3 with the winner


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def data(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    n = STEPS * BATCH * world
    return torch.randn(n, 6, generator=gen), torch.randn(n, 3, generator=gen)


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train_worker(ctx, allreduce: str):
    model = make_model()
    dp = DataParallel(model, optimizer(model), "ssgd", ctx=ctx, allreduce=allreduce)
    x, y = data(ctx.world_size)
    for step in range(STEPS):
        start = (step * ctx.world_size + ctx.rank) * BATCH
        dp.zero_grad()
        loss = nn.functional.mse_loss(dp(x[start : start + BATCH]), y[start : start + BATCH])
        loss.backward()
        dp.step()
    impl = dp.strategy.allreduce
    info = {
        "choice": getattr(impl, "choice", None),
        "measurements": getattr(impl, "measurements", None),
        "agreed": getattr(impl, "agreed", None),
        "count": impl.count,
    }
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    dp.close()
    return weights, info


def reference(world: int) -> torch.Tensor:
    model = make_model()
    opt = optimizer(model)
    x, y = data(world)
    union = BATCH * world
    for step in range(STEPS):
        opt.zero_grad()
        sl = slice(step * union, (step + 1) * union)
        nn.functional.mse_loss(model(x[sl]), y[sl]).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("allreduce,world", [("rhd", 3), ("auto", 2), ("auto", 3)])
def test_ssgd_equals_single_process_sgd(allreduce, world):
    results = launch("fabric.allreduce.test_autotune:train_worker", world, allreduce, timeout=120)
    want = reference(world)
    for rank, (weights, info) in enumerate(results):
        error = float((weights - want).norm() / want.norm())
        assert error < 1e-5, f"--allreduce {allreduce} rank {rank}: relative error {error}"
        assert info["count"] == STEPS
    if allreduce == "auto":
        choices = {info["choice"] for _, info in results}
        assert len(choices) == 1, f"ranks chose differently: {choices}"
        for _, info in results:
            assert set(info["measurements"]) == {"shm", "gloo", "ring", "rhd", "tree"}
            assert all(len(times) == 2 for times in info["measurements"].values())
            # every rank holds the same agreed figures, and picked their minimum
            assert info["agreed"] == results[0][1]["agreed"]
            assert info["choice"] == min(info["agreed"], key=info["agreed"].get)


def test_unknown_allreduce_names_the_flag():
    with pytest.raises(ValueError, match=r"--allreduce 'fastest'.*choose one of shm, gloo"):
        build_allreduce("fastest", None, 10)
    with pytest.raises(ValueError, match="own candidate"):
        build_allreduce("auto", None, 10, candidates=("rhd", "auto"))
    with pytest.raises(ValueError, match="'bogus'"):
        build_allreduce("auto", None, 10, candidates=("rhd", "bogus"))
