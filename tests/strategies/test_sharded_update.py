"""``ssgd --sharded-update`` (ZeRO-1 inside a host): the weights equal
single-process SGD on the union batch, each rank holds momentum for its chunk only, and
a saved state resumes exactly."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shmtrain.parallel.data_parallel import DataParallel
from shmtrain.runtime.launch.launcher import launch
from shmtrain.strategies.ssgd import SSGD
from shmtrain.strategies.ssgd.sharded import check_optimizer
from support.reference import batches, flat_params, relative_error, tiny_model, worker_batch

STEPS, BATCH = 8, 8
SGD = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}


def reference_sgd(steps: int, batch: int, world: int, sgd: dict[str, Any]) -> list[torch.Tensor]:
    """Weights after every step of torch.optim.SGD(**sgd) on the union batch, one process."""
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), **sgd)
    x, y = batches(steps, batch * world)
    history = []
    for step in range(steps):
        span = slice(step * batch * world, (step + 1) * batch * world)
        opt.zero_grad()
        nn.CrossEntropyLoss()(model(x[span]), y[span]).backward()
        opt.step()
        history.append(flat_params(model))
    return history


def sharded_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    x, y = batches(STEPS, BATCH * ctx.world_size)
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), **payload["sgd"])
    dp = DataParallel(model, opt, "ssgd", ctx=ctx, sharded_update=True)
    history = []
    for step in range(STEPS):
        xs, ys = worker_batch(x, y, step, ctx.rank, BATCH, ctx.world_size)
        dp.zero_grad()
        nn.CrossEntropyLoss()(dp(xs), ys).backward()
        dp.step()
        history.append(flat_params(model))
    strategy = dp.strategy
    result = {
        "history": history,
        "momentum_bytes": strategy.momentum_bytes(),
        "chunk": (strategy.lo, strategy.hi),
        "numel": strategy.layout.numel,
        "optimizer_state": len(opt.state),
        "shared": model[0].weight.data_ptr() == strategy.weights.data_ptr(),
    }
    dp.close()
    result["after_close"] = flat_params(model)
    return result


@pytest.mark.parametrize(("workers", "sgd"), [
    (1, SGD),
    (2, SGD),
    (4, SGD),
    (2, {"lr": 0.05, "momentum": 0.8, "dampening": 0.3, "weight_decay": 1e-2}),
    (2, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
])
def test_sharded_update_matches_single_process_sgd(workers: int, sgd: dict[str, Any]) -> None:
    reference = reference_sgd(STEPS, BATCH, workers, sgd)
    results = launch("strategies.test_sharded_update:sharded_worker", workers, {"sgd": sgd})
    for rank, result in enumerate(results):
        for step in range(STEPS):
            assert relative_error(result["history"][step], reference[step]) < 1e-5, (rank, step)
        assert torch.equal(result["after_close"], result["history"][-1])
    assert relative_error(reference[0], reference[-1]) > 1e-2  # the weights moved


def test_each_rank_holds_momentum_for_its_chunk_only() -> None:
    results = launch("strategies.test_sharded_update:sharded_worker", 4, {"sgd": SGD})
    numel = results[0]["numel"]
    chunks = [r["chunk"] for r in results]
    # the chunks tile the flat parameters, in rank order
    assert chunks[0][0] == 0 and chunks[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False))
    for r in results:
        lo, hi = r["chunk"]
        assert r["momentum_bytes"] == (hi - lo) * 4
        assert r["momentum_bytes"] < numel * 4 // 2  # a whole momentum copy would be numel*4
        assert r["optimizer_state"] == 0  # torch's optimizer holds nothing
        assert r["shared"]  # the model's weights are views of the host's segment
    assert sum(r["momentum_bytes"] for r in results) == numel * 4


def test_sharded_update_resume_is_exact() -> None:
    from support.resume import assert_exact_resume

    states = assert_exact_resume({"strategy": "ssgd", "options": {"sharded_update": True}})
    for state in states:
        lo, hi = state["strategy"]["chunk"]
        assert state["strategy"]["momentum"].numel() == hi - lo
        assert state["optimizer"]["state"] == {}
    assert states[0]["strategy"]["chunk"] != states[1]["strategy"]["chunk"]


def test_sharded_update_refuses_other_optimizers_and_transports() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match="torch.optim.SGD only"):
        check_optimizer(torch.optim.Adam(model.parameters()))
    with pytest.raises(ValueError, match="maximize"):
        check_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, maximize=True))
    check_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    with pytest.raises(ValueError, match="--sharded-update with --overlap"):
        SSGD.Config(sharded_update=True, overlap=True)
    with pytest.raises(ValueError, match="--allreduce 'ring'"):
        SSGD.Config(sharded_update=True, allreduce="ring")


@pytest.mark.slow
def test_sharded_update_across_two_hosts_equals_one_host_of_four(tmp_path) -> None:
    """Two hosts of 2 (torchrun on this machine): the hosts' leaders allreduce, then each
    host shards its own update; the weights equal plain ssgd on one host of four."""
    import subprocess
    import sys

    from support.torchrun import env, two_hosts

    common = ["--strategy", "ssgd", "--iterations", "10", "--batch-size", "8", "--seed", "3",
              "--no-progress"]
    two_hosts(tmp_path / "two", [*common, "--sharded-update"])
    assert "sharded-update = true" in (tmp_path / "two" / "config.toml").read_text()
    subprocess.run([sys.executable, "-m", "shmtrain", "train", *common, "--workers", "4",
                    "--out", str(tmp_path / "one")], check=True, timeout=150, env=env(), capture_output=True)
    one = torch.load(tmp_path / "one" / "model.pt")
    two = torch.load(tmp_path / "two" / "model.pt")
    for key in one:
        assert float((two[key] - one[key]).norm() / one[key].norm()) < 1e-5, key
