"""The state contract: ``Trainer.state_dict()`` (model, optimizer, strategy, loop state
after ``quiesce()``) taken mid-run and loaded into a fresh job on a fresh fabric
continues the run exactly (synchronous strategies), or from the saved global weights
(asynchronous ones)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from reference import batches, flat_params, relative_error, tiny_model, worker_batch
from shmtrain.api import DataParallel
from shmtrain.runtime.launch.launcher import launch
from shmtrain.runtime.train.trainer import Trainer, TrainState
from shmtrain.timing import PhaseTimer

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


SYNCHRONOUS = [
    ("ssgd", {}),
    pytest.param("ssgd", {"overlap": True, "bucket_mb": 0.001}, marks=pytest.mark.slow),
    pytest.param("gpi", {}, marks=pytest.mark.slow),
    pytest.param("cpu_acc", {}, marks=pytest.mark.slow),
]


def assert_exact_resume(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """A 2-worker run saved after HALF iterations and resumed in a fresh launch ends with
    the straight run's weights; the saved states (for further checks)."""
    first = launch("test_state:resume_worker", 2, dict(payload, mode="first"))
    states = [r["state"] for r in first]
    resumed = launch("test_state:resume_worker", 2, dict(payload, mode="resume", states=states))
    for a, b in zip(first, resumed, strict=True):
        assert b["iteration"] == 2 * HALF
        assert relative_error(b["final"], a["final"]) < 1e-6
    # the second half moved the weights: equality is not trivial
    mid = torch.cat([v.reshape(-1) for v in states[0]["model"].values()])
    assert relative_error(mid, first[0]["final"]) > 1e-3
    return states


@pytest.mark.parametrize(("strategy", "options"), SYNCHRONOUS)
def test_synchronous_resume_is_exact(strategy: str, options: dict[str, Any]) -> None:
    states = assert_exact_resume({"strategy": strategy, "options": options})
    assert all(s["strategy"]["iteration"] == HALF for s in states)


def test_seasgd_resume_continues_from_the_saved_global_weights() -> None:
    """One worker: the update thread's exchange is then a deterministic sequence, so the
    resumed run must equal the straight one; the master's state holds W_g."""
    payload = {"strategy": "seasgd", "options": {"moving_rate": 0.3}}
    first = launch("test_state:resume_worker", 1, dict(payload, mode="first"))
    state = first[0]["state"]
    assert state["strategy"]["global_weights"].shape == first[0]["final"].shape
    resumed = launch("test_state:resume_worker", 1, dict(payload, mode="resume", states=[state]))
    assert relative_error(resumed[0]["final"], first[0]["final"]) < 1e-6


def test_train_state_rng_round_trip() -> None:
    state = TrainState(iteration=7)
    state.capture_rng()
    expected = torch.rand(3)
    torch.rand(5)
    state.restore_rng()
    assert torch.equal(torch.rand(3), expected)
    assert state.position(3) == (2, 1)
