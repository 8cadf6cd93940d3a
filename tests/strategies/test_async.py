"""Asynchronous strategies: their equations step by step, conservation of the buffer
service under concurrency and SIGKILL, hybrid groups, bad options."""

from __future__ import annotations

import math
import os
import signal
from typing import Any

import pytest
import torch
from torch import nn

from shmtrain.fabric.smb import STATE_TRAINING, LocalBufferService
from shmtrain.parallel.data_parallel import DataParallel, make_config
from shmtrain.runtime.launch.launcher import WorkerFailed, launch
from shmtrain.strategies.elastic.eq8 import check_eq8
from support.reference import batches, flat_params, relative_error, tiny_model, worker_batch

STEPS, BATCH, LR, ALPHA = 12, 8, 0.1, 0.5


def _grad(model: nn.Module, weights: torch.Tensor, xs, ys) -> torch.Tensor:
    """Gradient of the loss at ``weights`` (the plain re-implementation's G_x)."""
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(weights[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
    model.zero_grad()
    nn.functional.cross_entropy(model(xs), ys).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def reference(strategy: str, tau: int, x, y) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Local and global weights after each step, straight from the paper's equations."""
    model = tiny_model()
    w = flat_params(model)
    wg = w.clone()
    fetched = w.clone()
    local, global_ = [], []
    for t in range(STEPS):
        xs, ys = worker_batch(x, y, t, 0, BATCH, 1)
        exchange = t % tau == 0
        if strategy == "seasgd" and exchange:
            dw = ALPHA * (w - wg)  # (5)
            w, wg = w - dw, wg + dw  # (6), (7)
        if strategy == "easgd" and exchange:
            diff = ALPHA * (w - wg)
        g = _grad(model, w, xs, ys)
        if strategy == "downpour" and tau == 1:
            wg = wg - LR * g  # (1)
            w = wg.clone()
        else:
            w = w - LR * g  # (2)
        if strategy == "easgd" and exchange:
            w, wg = w - diff, wg + diff  # (3), (4)
        if strategy == "downpour" and tau > 1 and (t + 1) % tau == 0:
            wg = wg + (w - fetched)
            w, fetched = wg.clone(), wg.clone()
        local.append(w.clone())
        global_.append(wg.clone())
    return local, global_


def equations_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    strategy, tau = payload["strategy"], payload["tau"]
    options = {"update_interval": tau}
    if strategy != "downpour":
        options["moving_rate"] = ALPHA
    x, y = batches(STEPS, BATCH)
    model = tiny_model()
    dp = DataParallel(model, torch.optim.SGD(model.parameters(), lr=LR), strategy, ctx=ctx, **options)
    s = dp.strategy
    local, global_ = [], []
    for t in range(STEPS):
        xs, ys = worker_batch(x, y, t, 0, BATCH, 1)
        dp.zero_grad()
        nn.functional.cross_entropy(dp(xs), ys).backward()
        dp.step()
        if strategy == "seasgd":
            s.exchange._await_idle("the test's read")  # one worker: the update has landed
        local.append(flat_params(model))
        global_.append(s.service.read(s.global_weights, torch.empty(s.layout.numel)))
    dp.close()
    return {"local": local, "global": global_, "reference": reference(strategy, tau, x, y)}


@pytest.mark.parametrize(
    "strategy,tau", [("seasgd", 1), ("seasgd", 3), ("easgd", 1), ("easgd", 2), ("downpour", 1), ("downpour", 3)]
)
def test_equations_step_by_step(strategy: str, tau: int) -> None:
    out = launch("strategies.test_async:equations_worker", 1, {"strategy": strategy, "tau": tau})[0]
    ref_local, ref_global = out["reference"]
    for t in range(STEPS):
        assert relative_error(out["local"][t], ref_local[t]) < 1e-5, ("local", t)
        assert relative_error(out["global"][t], ref_global[t]) < 1e-5, ("global", t)
    assert relative_error(ref_global[0], ref_global[-1]) > 1e-3  # W_g did move
    if strategy != "downpour":  # the elastic terms matter: local and global differ
        assert relative_error(ref_local[-1], ref_global[-1]) > 1e-4


# -- conservation: no increment lost or applied twice ---------------------------------
NUMEL, INCREMENTS = 2053, 40


def pattern() -> torch.Tensor:
    return (torch.arange(NUMEL) % 7 + 1).to(torch.float32)


def conservation_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    victim, kill_at, mode = payload.get("victim"), payload.get("kill_at"), payload.get("mode")
    smb = LocalBufferService(ctx.host)
    if smb.rank == 0:
        total = smb.attach(smb.create("total", NUMEL))
    increment = smb.attach(smb.create(f"increment.{smb.rank}", NUMEL))
    if smb.rank:
        total = smb.attach(smb.lookup("total"))
    smb.ready()
    smb.board.set_progress(0, STATE_TRAINING)
    base = pattern()
    for m in range(INCREMENTS):
        smb.write(increment, base * float((smb.rank + 1) * (m + 1)))  # waits for the last one
        ticket = smb.accumulate(increment, total)  # no wait: requests overlap
        if smb.rank == victim and m == kill_at:
            if mode == "midwrite":  # die half-way through writing the next increment
                smb.wait(ticket)
                increment.storage[: NUMEL // 2] = float("nan")
            os.kill(os.getpid(), signal.SIGKILL)
    smb.close()  # the owner returns only once every live peer has left
    out = {"rank": smb.rank}
    if smb.rank == 0:
        out["total"] = smb.read(total, torch.empty(NUMEL))
        out["applied"] = smb.applied
    return out


def expected_total(world: int, victim=None, kept: int = INCREMENTS) -> torch.Tensor:
    coefficient = 0
    for rank in range(world):
        count = kept if rank == victim else INCREMENTS
        coefficient += (rank + 1) * count * (count + 1) // 2
    assert coefficient * 7 < 2**24  # every partial sum is an exact float32 integer
    return pattern() * float(coefficient)


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_concurrent_increments_sum_exactly(workers: int) -> None:
    results = launch("strategies.test_async:conservation_worker", workers, {}, timeout=150)
    assert torch.equal(results[0]["total"], expected_total(workers))
    assert results[0]["applied"] == workers * INCREMENTS


@pytest.mark.parametrize("mode", ["posted", "midwrite"])
def test_sigkill_leaves_exactly_the_applied_increments(mode: str) -> None:
    workers, victim, kill_at = 3, 2, 9
    with pytest.raises(WorkerFailed) as info:
        launch("strategies.test_async:conservation_worker", workers,
               {"victim": victim, "kill_at": kill_at, "mode": mode}, tolerate_worker_loss=True)
    assert info.value.rank == victim and "SIGKILL" in str(info.value)
    survivors = info.value.results
    assert sorted(survivors) == [0, 1]
    total = survivors[0]["total"]
    # a posted request is applied whole even if its writer died; a half-written one never
    assert torch.equal(total, expected_total(workers, victim, kept=kill_at + 1))
    assert not torch.isnan(total).any()


# -- SIGKILL during training: the others train to the end -----------------------------
def training_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    x, y = batches(payload["target"] * 3, BATCH, seed=ctx.rank + 5)
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    dp = DataParallel(model, opt, payload["strategy"], ctx=ctx, **payload.get("options", {}))
    s = dp.strategy
    s.target_iterations = payload["target"]
    initial = s.service.read(s.global_weights, torch.empty(s.layout.numel))
    step = 0
    while not dp.should_stop():
        if ctx.rank == payload.get("victim") and step == payload.get("kill_at"):
            os.kill(os.getpid(), signal.SIGKILL)
        xs, ys = worker_batch(x, y, step % (payload["target"] * 3), 0, BATCH, 1)
        dp.zero_grad()
        nn.functional.cross_entropy(dp(xs), ys).backward()
        dp.step()
        step += 1
    dp.close()
    final = s.service.read(s.global_weights, torch.empty(s.layout.numel))
    return {
        "iterations": s.iteration,
        "finite": bool(torch.isfinite(final).all()),
        "moved": relative_error(final, initial),
        "weights": flat_params(model),
    }


@pytest.mark.parametrize("strategy", [
    "seasgd", pytest.param("easgd", marks=pytest.mark.slow), pytest.param("downpour", marks=pytest.mark.slow),
])
def test_sigkill_of_one_async_worker_leaves_the_others_training(strategy: str) -> None:
    target = 25
    payload = {"strategy": strategy, "target": target, "victim": 2, "kill_at": 4}
    with pytest.raises(WorkerFailed) as info:
        launch("strategies.test_async:training_worker", 3, payload, tolerate_worker_loss=True)
    assert info.value.rank == 2 and "SIGKILL" in str(info.value)
    survivors = info.value.results
    assert sorted(survivors) == [0, 1]
    for result in survivors.values():
        assert result["finite"] and result["moved"] > 1e-3
    # "average": the survivors make up for the dead worker's missing iterations
    counts = [survivors[0]["iterations"], survivors[1]["iterations"], 4]
    assert sum(counts) >= 3 * target and sum(counts) <= 3 * target + 3
    assert min(counts[:2]) > 4  # both trained on after the death


# -- hsgd ------------------------------------------------------------------------------
def test_hsgd_groups_stay_synchronous_and_differ_between_groups() -> None:
    target = 20
    payload = {"strategy": "hsgd", "target": target, "options": {"groups": 2, "group_size": 2, "terminate": "first"}}
    results = launch("strategies.test_async:training_worker", 4, payload)
    for group in (0, 1):  # members hold exactly their root's weights
        root, member = results[2 * group], results[2 * group + 1]
        assert torch.equal(root["weights"], member["weights"]), group
        assert root["iterations"] == member["iterations"] <= target
    assert max(r["iterations"] for r in results) == target  # "first": the first finisher's count
    # the groups saw different data and are only elastically coupled
    assert relative_error(results[0]["weights"], results[2]["weights"]) > 1e-4
    assert all(r["finite"] and r["moved"] > 1e-3 for r in results)


def bad_groups_worker(ctx, payload: dict[str, Any]) -> str:
    model = tiny_model()
    try:
        DataParallel(model, torch.optim.SGD(model.parameters(), lr=LR), "hsgd", ctx=ctx, **payload)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_bad_groups_are_named() -> None:
    message = launch("strategies.test_async:bad_groups_worker", 1, {"groups": 2, "group_size": 2})[0]
    assert "--groups 2" in message and "--group-size 2" in message and "workers (1)" in message


@pytest.mark.parametrize(
    "strategy,options,flag",
    [
        ("seasgd", {"moving_rate": 0.0}, "--moving-rate 0.0"),
        ("easgd", {"moving_rate": 1.5}, "--moving-rate 1.5"),
        ("seasgd", {"update_interval": 0}, "--update-interval 0"),
        ("downpour", {"terminate": "last"}, "--terminate 'last'"),
        ("hsgd", {"groups": 0}, "--groups 0"),
    ],
)
def test_bad_options_are_named(strategy: str, options: dict, flag: str) -> None:
    with pytest.raises(ValueError) as info:
        make_config(strategy, options)
    assert flag in str(info.value)


def test_check_eq8() -> None:
    hidden = {"compute": 0.1, "forward": 0.04, "backward": 0.05, "update": 0.01, "rgw": 0.002,
              "ulw": 0.003, "wait": 0.0, "wwi": 0.01, "ugw": 0.02, "comm": 0.005, "iteration": 0.105}
    result = check_eq8([{"time": hidden}] * 5)
    assert result["holds"] and math.isclose(result["T_iter_eq8"], 0.105)
    assert math.isclose(result["exposed_fraction"], 0.005 / 0.105)
    # the update takes longer than compute: the main thread must wait for the difference
    slow = dict(hidden, wwi=0.05, ugw=0.1, wait=0.05, iteration=0.155)
    assert check_eq8([{"time": slow}] * 5)["holds"]
    # a wait that eq. (8) does not explain
    assert not check_eq8([{"time": dict(slow, wait=0.2, iteration=0.305)}] * 5)["holds"]


def test_hsgd_check_world_before_launch() -> None:
    from shmtrain.strategies.elastic.hsgd import HSGD

    assert HSGD.check_world(make_config("hsgd", {"groups": 2}), 4) == 2
    assert HSGD.check_world(make_config("hsgd", {"groups": 2, "group_size": 3}), 6) == 3
    with pytest.raises(ValueError, match="--groups 3 does not divide the 4 workers"):
        HSGD.check_world(make_config("hsgd", {"groups": 3}), 4)
    with pytest.raises(ValueError, match=r"--groups 2 x --group-size 3 = 6 must equal the number of workers \(4\)"):
        HSGD.check_world(make_config("hsgd", {"groups": 2, "group_size": 3}), 4)
    # across hosts (a memory server holds the global weights) the group rules still apply
    with pytest.raises(ValueError, match="--groups 3 does not divide the 4 workers"):
        HSGD.check_world(make_config("hsgd", {"groups": 3}), 4, num_nodes=2)
