"""Exact resume through the state contract: a 2-worker run whose ``Trainer.state_dict()``
is taken after HALF iterations and loaded into a fresh launch on a fresh fabric must end
with the straight run's weights (the strategies' tests call :func:`assert_exact_resume`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shmtrain.parallel.data_parallel import DataParallel
from shmtrain.runtime.launch.launcher import launch
from shmtrain.runtime.train.trainer import Trainer
from shmtrain.timing import PhaseTimer
from support.reference import batches, flat_params, relative_error, tiny_model, worker_batch

HALF, BATCH = 6, 8


def resume_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    """``first``: run 2*HALF steps, taking the state after HALF; ``resume``: load the
    state this rank took and run the second HALF on a fresh fabric."""
    torch.manual_seed(0)
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    timer = PhaseTimer()
    dp = DataParallel(model, opt, payload["strategy"], ctx=ctx, timer=timer, **payload["options"])
    trainer = Trainer(dp, nn.CrossEntropyLoss(), timer)
    x, y = batches(2 * HALF, BATCH * ctx.world_size)
    state = None
    if payload["mode"] == "resume":
        trainer.load_state_dict(payload["states"][ctx.rank])
        assert dp.strategy.iteration == HALF and trainer.state.iteration == HALF
    while trainer.state.iteration < 2 * HALF:
        step = trainer.state.iteration
        trainer.step(*worker_batch(x, y, step, ctx.rank, BATCH, ctx.world_size))
        timer.finish_iteration()
        if trainer.state.iteration == HALF and payload["mode"] == "first":
            state = trainer.state_dict()
    result = {"final": flat_params(model), "state": state, "iteration": dp.strategy.iteration}
    dp.close()
    return result


def assert_exact_resume(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """A 2-worker run saved after HALF iterations and resumed in a fresh launch ends with
    the straight run's weights; the saved states (for further checks)."""
    first = launch("support.resume:resume_worker", 2, dict(payload, mode="first"))
    states = [r["state"] for r in first]
    resumed = launch("support.resume:resume_worker", 2, dict(payload, mode="resume", states=states))
    for a, b in zip(first, resumed, strict=True):
        assert b["iteration"] == 2 * HALF
        assert relative_error(b["final"], a["final"]) < 1e-6
    # the second half moved the weights: equality is not trivial
    mid = torch.cat([v.reshape(-1) for v in states[0]["model"].values()])
    assert relative_error(mid, first[0]["final"]) > 1e-3
    return states
