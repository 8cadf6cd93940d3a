"""A DDP loop converted by changing its wrapper line only (shmtrain/ddp_style.py): the
weights equal DDP's over gloo for the synchronous strategies, the asynchronous ones run
the same loop, the patterns that would skip communication raise with the fix, join()
equals DDP's join on uneven inputs, close() leaves the script's process group, and a peer
that finished early is named as finished, not dead."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shmtrain.parallel.data_parallel import DataParallel
from shmtrain.runtime.launch.launcher import WorkerFailed, launch
from shmtrain.strategies.layout.staging import STAGING_ENV
from support.paths import TESTS
from support.reference import batches, ddp_step, flat_params, relative_error, tiny_model, worker_batch

STEPS, BATCH, CLIP = 20, 8, 0.5


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.05, betas=(0.9, 0.95))


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)


OPTIMIZERS = {"adamw": adamw, "sgd": sgd}


def ddp_loop(model: nn.Module, opt: torch.optim.Optimizer, steps: list[tuple[torch.Tensor, torch.Tensor]],
             clip: float | None) -> tuple[list[torch.Tensor], int]:
    """The plain DDP loop, written once for both wrappers; the weights after each step and
    how often the clip bit."""
    history, clipped = [], 0
    for xs, ys in steps:
        clipped += ddp_step(model, opt, xs, ys, clip)
        history.append(flat_params(model))
    return history, clipped


def against_ddp_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    """The same loop under DDP over gloo and under DataParallel (the wrapper line only)."""
    from torch.nn.parallel import DistributedDataParallel

    clip = payload["clip"]
    x, y = batches(STEPS, BATCH * ctx.world_size)
    steps = [worker_batch(x, y, s, ctx.rank, BATCH, ctx.world_size) for s in range(STEPS)]
    make = OPTIMIZERS[payload["optimizer"]]
    if payload.get("staged"):  # the GPU data flow on the CPU: private device gradients, copies
        os.environ[STAGING_ENV] = "copy"
    net = tiny_model()
    opt = make(net)
    theirs, _ = ddp_loop(DistributedDataParallel(net), opt, steps, clip)
    net = tiny_model()
    opt = make(net)
    model = DataParallel(net, opt, payload["strategy"], ctx=ctx, **payload["options"])
    ours, clipped = ddp_loop(model, opt, steps, clip)
    assert model.strategy.staged == bool(payload.get("staged"))
    model.close()
    return {"ours": ours, "ddp": theirs, "clipped": clipped}


# Every case with AdamW, whose m / sqrt(v) turns an ulp of difference where the ranks'
# gradients nearly cancel into a whole step: the two-worker mean of ssgd --overlap and gpi
# is (a + b) / 2, rounded as DDP's is (a lerp, exact to an ulp of the operands only, failed here).
SYNC_CASES = {
    "ssgd": ("ssgd", {}, CLIP, 2, "adamw"),
    "ssgd-4": ("ssgd", {}, CLIP, 4, "adamw"),
    "ssgd-overlap": ("ssgd", {"overlap": True, "bucket_mb": 0.001}, CLIP, 2, "adamw"),
    "ssgd-overlap-4": ("ssgd", {"overlap": True, "bucket_mb": 0.001}, CLIP, 4, "adamw"),
    "cpu_acc": ("cpu_acc", {}, CLIP, 2, "adamw"),
    "ps_grad": ("ps_grad", {}, CLIP, 2, "adamw"),
    "gpi": ("gpi", {}, None, 2, "adamw"),  # updates during backward: a clip between is refused (below)
    # staged (the GPU path, on the CPU): the mean copied back into param.grad before the clip
    "ssgd-staged": ("ssgd", {}, CLIP, 2, "adamw", True),
    "cpu_acc-staged": ("cpu_acc", {}, CLIP, 2, "adamw", True),
    "ps_grad-staged": ("ps_grad", {}, CLIP, 2, "adamw", True),
}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", sorted(SYNC_CASES))
def test_a_ddp_loop_converted_by_its_wrapper_line_equals_ddp(case: str) -> None:
    strategy, options, clip, workers, optimizer, *staged = SYNC_CASES[case]
    payload = {"strategy": strategy, "options": options, "clip": clip, "optimizer": optimizer, "staged": bool(staged)}
    results = launch("parallel.test_ddp_style:against_ddp_worker", workers, payload, threads=1)
    for rank, result in enumerate(results):
        for step in range(STEPS):
            assert relative_error(result["ours"][step], result["ddp"][step]) < 1e-5, (case, rank, step)
    assert relative_error(results[0]["ddp"][0], results[0]["ddp"][-1]) > 1e-2  # the weights moved
    if clip is not None:
        assert results[0]["clipped"] > 0, "the clip must bite in some step, or the test shows nothing"


def async_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    x, y = batches(STEPS, BATCH * ctx.world_size)
    steps = [worker_batch(x, y, s, ctx.rank, BATCH, ctx.world_size) for s in range(STEPS)]
    net = tiny_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model = DataParallel(net, opt, payload["strategy"], ctx=ctx, **payload["options"])
    first = flat_params(net)
    refused = ""
    try:
        with model.join():  # asynchronous: leaving it marks this worker done for TERM
            history, _ = ddp_loop(model, opt, steps, CLIP)
    except ValueError as exc:  # hsgd's groups are synchronous inside: it has no shadow step
        refused = str(exc)
        history, _ = ddp_loop(model, opt, steps, CLIP)
    done = model.strategy.termination.stopped
    iteration = model.iteration
    model.close()
    state = model.global_state_dict()  # rank 0: the job's W_g, which only the exchanges move
    centre = None if state is None else torch.cat([state[n].reshape(-1) for n, _ in net.named_parameters()])
    return {"first": first, "last": history[-1], "iteration": iteration, "centre": centre, "refused": refused,
            "done": done}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy,options", [
    ("seasgd", {"update_interval": 2}), ("easgd", {"update_interval": 2}), ("hsgd", {"groups": 2, "group_size": 1}),
])
def test_the_same_loop_runs_the_asynchronous_strategies(strategy: str, options: dict[str, Any]) -> None:
    results = launch("parallel.test_ddp_style:async_worker", 2, {"strategy": strategy, "options": options}, threads=1)
    for result in results:
        if strategy == "hsgd":
            assert "join() with --strategy hsgd" in result["refused"] and "same number of batches" in result["refused"]
        else:
            assert not result["refused"] and result["done"]  # join() ended it for TERM
        assert torch.isfinite(result["last"]).all()
        assert result["iteration"] == STEPS  # every optimizer.step() was the strategy's iteration
        assert relative_error(result["first"], result["last"]) > 1e-3
    centre = results[0]["centre"]
    assert centre is not None and torch.isfinite(centre).all()
    assert relative_error(centre, results[0]["first"]) > 1e-4  # the exchanges moved W_g


def patterns_worker(ctx, payload: dict[str, Any]) -> dict[str, str]:
    """Every rank runs the same misuse; each raises before any exchange is skipped."""
    x, y = batches(2, BATCH * ctx.world_size)
    xs, ys = worker_batch(x, y, 0, ctx.rank, BATCH, ctx.world_size)
    loss_fn = nn.CrossEntropyLoss()
    net = tiny_model()
    opt = adamw(net)
    model = DataParallel(net, opt, payload["strategy"], ctx=ctx)
    errors: dict[str, str] = {}

    def attempt(name: str, body) -> None:
        try:
            body()
        except (RuntimeError, ValueError) as exc:
            errors[name] = str(exc)

    attempt("step without backward", opt.step)
    opt.zero_grad()
    loss_fn(model(xs), ys).backward()
    attempt("second backward", lambda: loss_fn(model(xs), ys).backward())
    attempt("closure", lambda: opt.step(lambda: 0.0))
    opt.step()  # the first backward's step still works
    attempt("backward without zero_grad", lambda: loss_fn(model(xs), ys).backward())
    opt.zero_grad()
    with model.no_sync():
        loss_fn(model(xs), ys).backward()
    attempt("no_sync only", opt.step)
    loss_fn(model(xs), ys).backward()  # the last micro-batch outside no_sync: then the step is fine
    opt.step()
    if payload["strategy"] == "gpi":
        opt.zero_grad()
        loss_fn(model(xs), ys).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1e-3)
        attempt("edit", opt.step)
    else:  # another optimizer's step is not the step: the next backward says so
        other = torch.optim.SGD(net.parameters(), lr=0.1)
        opt.zero_grad()
        loss_fn(model(xs), ys).backward()
        other.step()
        opt.zero_grad()
        attempt("other optimizer", lambda: loss_fn(model(xs), ys).backward())
    model.close()
    errors["iteration"] = str(model.iteration)
    return errors


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ssgd", "gpi"])
def test_patterns_that_would_skip_communication_raise_with_the_fix(strategy: str) -> None:
    results = launch("parallel.test_ddp_style:patterns_worker", 2, {"strategy": strategy}, threads=1)
    for errors in results:
        assert "no backward since the last step" in errors["step without backward"]
        assert "loss.backward() first" in errors["step without backward"]
        assert "second backward before optimizer.step()" in errors["second backward"]
        assert "no_sync()" in errors["second backward"]
        assert "no closure" in errors["closure"]
        assert "no zero_grad() since" in errors["backward without zero_grad"]
        assert "inside model.no_sync() only" in errors["no_sync only"]
        assert "outside no_sync()" in errors["no_sync only"]
        if strategy == "gpi":
            assert "cannot honour" in errors["edit"] and "--strategy ssgd" in errors["edit"]
            assert "as its reduced gradient arrives during backward" in errors["edit"]
        else:
            assert "second backward before optimizer.step()" in errors["other optimizer"]
            assert "the optimizer given to DataParallel" in errors["other optimizer"]
        assert errors["iteration"] == "2"  # the two good steps only


def join_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    """Rank r has 3 + 2r batches; DDP's join and ours on the same data."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    mine = 3 + 2 * ctx.rank
    x, y = batches(mine, BATCH * ctx.world_size)
    steps = [worker_batch(x, y, s, ctx.rank, BATCH, ctx.world_size) for s in range(mine)]
    net = tiny_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    ddp = DistributedDataParallel(net)
    with Join([ddp]):
        ddp_loop(ddp, opt, steps, None)
    theirs = flat_params(net)
    net = tiny_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model = DataParallel(net, opt, payload["strategy"], ctx=ctx, **payload["options"])
    with model.join():
        ddp_loop(model, opt, steps, None)
    iteration = model.iteration
    model.close()
    return {"ours": flat_params(net), "ddp": theirs, "iteration": iteration}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy,options", [("ssgd", {}), ("ssgd", {"overlap": True, "bucket_mb": 0.001}),
                                              ("cpu_acc", {}), ("gpi", {}), ("ps_grad", {})])
def test_join_with_uneven_inputs_equals_ddps_join(strategy: str, options: dict[str, Any]) -> None:
    results = launch("parallel.test_ddp_style:join_worker", 2, {"strategy": strategy, "options": options}, threads=1)
    for result in results:
        assert relative_error(result["ours"], result["ddp"]) < 1e-5
        assert result["iteration"] == 5  # the joined rank shadowed the others' last two steps
    assert relative_error(results[0]["ours"], results[1]["ours"]) == 0


def early_finish_worker(ctx, payload: dict[str, Any]) -> int:
    """Rank 1 takes one step fewer and closes, without join()."""
    x, y = batches(3, BATCH * ctx.world_size)
    steps = [worker_batch(x, y, s, ctx.rank, BATCH, ctx.world_size) for s in range(3 - ctx.rank)]
    net = tiny_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = DataParallel(net, opt, payload["strategy"], ctx=ctx)
    ddp_loop(model, opt, steps, None)
    model.close()
    return model.iteration


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ssgd", "gpi", "cpu_acc"])
def test_a_rank_that_finished_early_is_named_finished_with_join_as_the_fix(strategy: str) -> None:
    with pytest.raises(WorkerFailed) as caught:
        launch("parallel.test_ddp_style:early_finish_worker", 2, {"strategy": strategy}, threads=1, timeout=60)
    text = str(caught.value)
    assert "local rank 1" in text and "finished after 2 steps" in text, text
    assert "model.join()" in text and "died" not in text, text


SCRIPT = """
import os, sys, torch, torch.distributed as dist
from torch import nn
sys.path.insert(0, {tests!r})
from support.reference import tiny_model, batches
import shmtrain
dist.init_process_group("gloo")
net = tiny_model()
opt = torch.optim.SGD(net.parameters(), lr=0.1)
model = shmtrain.DataParallel(net, opt, "ssgd")  # the wrapper line; was DistributedDataParallel(net)
x, y = batches(2, 8, seed=dist.get_rank())
for s in range(2):
    opt.zero_grad()
    nn.CrossEntropyLoss()(model(x[s * 8:(s + 1) * 8]), y[s * 8:(s + 1) * 8]).backward()
    opt.step()
model.close()
assert dist.is_initialized(), "close() destroyed the script's process group"
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
# one write: no interleaving
sys.stdout.write("rank %s %d %d\\n" % (dist.is_initialized(), int(t.item()), model.iteration))
sys.stdout.flush()
os._exit(0)  # torch's gloo may abort at interpreter exit ("terminate called without an active exception")
"""


@pytest.mark.timeout(150)
def test_close_leaves_the_process_group_the_script_created(tmp_path: Path) -> None:
    from support.torchrun import FORK, env, free_port

    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(tests=str(TESTS)))
    cmd = FORK + ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                      str(script)]
    done = subprocess.run(cmd, timeout=140, env=env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("rank False 2 2") == 2, done.stdout


def test_ddp_style_off_keeps_model_step_as_the_only_step() -> None:
    net = tiny_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = DataParallel(net, opt, "single", ddp_style=False)
    x, y = batches(1, 8)
    model.zero_grad()
    nn.CrossEntropyLoss()(model(x), y).backward()
    model.step()
    opt.step()  # the optimizer's own step, unwrapped (no check, no exchange)
    assert model.iteration == 1
    with pytest.raises(ValueError, match="join\\(\\) needs the DDP-style loop"):
        model.join()
    model.close()
    assert sys.modules["shmtrain.parallel.ddp_style"]


@pytest.mark.parametrize("made", ["before", "after"])
def test_an_lr_scheduler_made_before_or_after_the_wrapper_sees_the_steps(made: str) -> None:
    """Its own wrapper of optimizer.step and ours compose either way, without its warnings."""
    import warnings

    net = tiny_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if made == "before" else None
    model = DataParallel(net, opt, "single")
    scheduler = scheduler or torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    x, y = batches(2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for s in range(2):
            opt.zero_grad()
            nn.CrossEntropyLoss()(model(x[s * 8:(s + 1) * 8]), y[s * 8:(s + 1) * 8]).backward()
            opt.step()
            scheduler.step()
    assert model.iteration == 2 and opt.param_groups[0]["lr"] == pytest.approx(0.025)
    model.close()
