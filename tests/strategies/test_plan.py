"""A strategy's job is checked once on every route: ``shmtrain train`` (the launcher
checks, the workers build from its plan), ``DataParallel`` in a user's loop, torchrun
(the configuration and the worker are one process)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from torch import nn

from shmtrain.runtime.config import job_shape, resolve
from shmtrain.runtime.launch.launcher import launch
from support.check_counts import counting

OPTIONS = {"strategy": "ssgd", "workers": 2, "model": "mlp", "data": "synthetic", "batch_size": 8}
ONCE = {"choose": 1, "check_hosts": 1, "check_world": 1, "check_optimizer": 1}


def route_worker(ctx, payload: dict[str, Any]) -> dict[str, int]:
    """Build ``DataParallel`` as ``payload["route"]`` does; what this process checked."""
    from shmtrain.parallel.data_parallel import DataParallel

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with counting() as counts:
        if payload["route"] == "train":  # the launcher's checked configuration, as the payload carries it
            config = payload["config"]
            dp = DataParallel(model, optimizer, config.strategy, config=config.strategy_config, ctx=ctx,
                              plan=config.plan)
        elif payload["route"] == "torchrun":  # the configuration built in the worker's own process
            config = resolve({**OPTIONS, "workers": ctx.world_size})
            dp = DataParallel(model, optimizer, config.strategy, config=config.strategy_config, ctx=ctx,
                              plan=config.plan)
        else:  # a user's loop
            dp = DataParallel(model, optimizer, "ssgd", ctx=ctx)
    dp.close()
    return dict(counts)


def test_shmtrain_train_checks_in_the_launcher_and_its_workers_check_nothing_again() -> None:
    with counting() as launcher:
        config = resolve(OPTIONS)
    assert dict(launcher) == {**ONCE, "check_variants": 1}
    payload = pickle.loads(pickle.dumps({"route": "train", "config": config}))
    assert payload["config"].plan.config is payload["config"].strategy_config  # one object after the trip
    for counts in launch("strategies.test_plan:route_worker", 2, payload, timeout=60):
        assert counts == {}, counts


@pytest.mark.parametrize("route", ["torchrun", "loop"])
def test_each_check_is_made_once_in_a_worker_that_checks_for_itself(route: str) -> None:
    for counts in launch("strategies.test_plan:route_worker", 2, {"route": route}, timeout=60):
        expected = {**ONCE, "check_variants": 1}
        assert counts == expected, counts


def test_a_plan_for_another_job_shape_is_checked_again() -> None:
    from shmtrain.strategies.base import build_config
    from shmtrain.strategies.plan import plan

    config = build_config("hsgd", {"groups": 2})
    planned = plan("hsgd", config, 4, optimizer="sgd")
    assert planned.fits(4, 1) and not planned.fits(4, 2) and planned.world == 2
    assert planned.covers("SGD") and not planned.covers("Adam")
    with pytest.raises(ValueError, match="--groups 3 does not divide the 4 workers"):
        plan("hsgd", build_config("hsgd", {"groups": 3}), 4)


def test_under_torchrun_the_job_shape_is_torchruns(monkeypatch) -> None:
    for name in ("SHMTRAIN_JOB_DIR", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert job_shape(3) == (3, 1)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert job_shape(3) == (4, 2)
