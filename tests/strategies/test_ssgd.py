"""ssgd equals single-process SGD on the union batch and PyTorch DDP, step by step."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shmtrain.parallel.data_parallel import DataParallel
from shmtrain.runtime.launch.launcher import launch
from support.reference import (
    batches,
    flat_params,
    relative_error,
    single_process_sgd,
    tiny_model,
    worker_batch,
)

STEPS, BATCH = 20, 8


def ssgd_and_ddp_worker(ctx, payload: dict[str, Any]) -> dict[str, list[torch.Tensor]]:
    from torch.nn.parallel import DistributedDataParallel

    steps, batch, options = payload["steps"], payload["batch"], payload.get("options", {})
    x, y = batches(steps, batch * ctx.world_size)
    loss_fn = nn.CrossEntropyLoss()
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    dp = DataParallel(model, opt, payload.get("strategy", "ssgd"), ctx=ctx, **options)
    ddp_model = tiny_model()
    ddp = DistributedDataParallel(ddp_model)
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    ours, theirs = [], []
    for step in range(steps):
        xs, ys = worker_batch(x, y, step, ctx.rank, batch, ctx.world_size)
        dp.zero_grad()
        loss_fn(dp(xs), ys).backward()
        dp.step()
        ours.append(flat_params(model))
        ddp_opt.zero_grad()
        loss_fn(ddp(xs), ys).backward()
        ddp_opt.step()
        theirs.append(flat_params(ddp_model))
    dp.close()
    return {"ssgd": ours, "ddp": theirs}


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_ssgd_matches_single_process_and_ddp(workers: int) -> None:
    reference = single_process_sgd(STEPS, BATCH, workers)
    results = launch("strategies.test_ssgd:ssgd_and_ddp_worker", workers, {"steps": STEPS, "batch": BATCH})
    for rank, result in enumerate(results):
        for step in range(STEPS):
            assert relative_error(result["ssgd"][step], reference[step]) < 1e-5, (rank, step)
            assert relative_error(result["ssgd"][step], result["ddp"][step]) < 1e-5, (rank, step)
    # the run moved the weights, so equality is not trivial
    assert relative_error(reference[0], reference[-1]) > 1e-2
