"""The state contract: ``Trainer.state_dict()`` (model, optimizer, strategy, loop state
after ``quiesce()``) taken mid-run and loaded into a fresh job on a fresh fabric
continues the run exactly (synchronous strategies), or from the saved global weights
(asynchronous ones)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shmtrain.runtime.launch.launcher import launch
from shmtrain.runtime.train.trainer import TrainState
from support.reference import relative_error
from support.resume import HALF, assert_exact_resume

SYNCHRONOUS = [
    ("ssgd", {}),
    pytest.param("ssgd", {"overlap": True, "bucket_mb": 0.001}, marks=pytest.mark.slow),
    pytest.param("gpi", {}, marks=pytest.mark.slow),
    pytest.param("cpu_acc", {}, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("strategy", "options"), SYNCHRONOUS)
def test_synchronous_resume_is_exact(strategy: str, options: dict[str, Any]) -> None:
    states = assert_exact_resume({"strategy": strategy, "options": options})
    assert all(s["strategy"]["iteration"] == HALF for s in states)


def test_seasgd_resume_continues_from_the_saved_global_weights() -> None:
    """One worker: the update thread's exchange is then a deterministic sequence, so the
    resumed run must equal the straight one; the master's state holds W_g."""
    payload = {"strategy": "seasgd", "options": {"moving_rate": 0.3}}
    first = launch("support.resume:resume_worker", 1, dict(payload, mode="first"))
    state = first[0]["state"]
    assert state["strategy"]["global_weights"].shape == first[0]["final"].shape
    resumed = launch("support.resume:resume_worker", 1, dict(payload, mode="resume", states=[state]))
    assert relative_error(resumed[0]["final"], first[0]["final"]) < 1e-6


def test_train_state_rng_round_trip() -> None:
    state = TrainState(iteration=7)
    state.capture_rng()
    expected = torch.rand(3)
    torch.rand(5)
    state.restore_rng()
    assert torch.equal(torch.rand(3), expected)
    assert state.position(3) == (2, 1)
