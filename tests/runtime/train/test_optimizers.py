"""``--optimizer``, ``--grad-clip`` and ``--accumulate``: the synchronous strategies step
any torch.optim optimizer on the averaged (clipped) gradient exactly as DDP over gloo does
with ``clip_grad_norm_``, micro-batches give the whole batch's gradient, and what a
strategy cannot honour is refused with its reason."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shmtrain.cli import main
from shmtrain.parallel.data_parallel import DataParallel
from shmtrain.runtime.launch.launcher import launch
from shmtrain.runtime.train.optimizers import build_optimizer, optimizer_kwargs
from shmtrain.runtime.train.trainer import Trainer
from shmtrain.timing import PhaseTimer
from support.paths import ROOT
from support.reference import batches, ddp_step, flat_params, relative_error, tiny_model, worker_batch

STEPS, BATCH, CLIP = 12, 8, 0.5


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.05, betas=(0.9, 0.95))


def nesterov(model: nn.Module) -> torch.optim.Optimizer:
    """SGD whose foreach step adds the momentum into the gradient in place (no weight decay)."""
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, foreach=True)


OPTIMIZERS = {"adamw": adamw, "nesterov": nesterov}


def against_ddp_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    """Our strategy through Trainer (clip, K micro-batches) and DDP over gloo with
    ``clip_grad_norm_`` on the whole batch, on the same data, side by side."""
    from torch.nn.parallel import DistributedDataParallel

    clip, k = payload["clip"], payload["accumulate"]
    x, y = batches(STEPS, BATCH * ctx.world_size)
    loss_fn = nn.CrossEntropyLoss()
    model = tiny_model()
    make = OPTIMIZERS[payload.get("optimizer", "adamw")]
    dp = DataParallel(model, make(model), payload["strategy"], ctx=ctx, grad_clip=clip, **payload["options"])
    trainer = Trainer(dp, loss_fn, PhaseTimer(), accumulate=k)
    ddp_model = tiny_model()
    ddp = DistributedDataParallel(ddp_model)
    ddp_opt = make(ddp_model)
    ours, theirs, clipped = [], [], 0
    for step in range(STEPS):
        xs, ys = worker_batch(x, y, step, ctx.rank, BATCH, ctx.world_size)
        trainer.step(xs, ys)
        ours.append(flat_params(model))
        clipped += ddp_step(ddp, ddp_opt, xs, ys, clip)
        theirs.append(flat_params(ddp_model))
    dp.close()
    return {"ours": ours, "ddp": theirs, "clipped": clipped}


CASES = {
    "ssgd": ("ssgd", {}, CLIP, 1),
    "ssgd-accumulate": ("ssgd", {}, CLIP, 3),
    "ssgd-overlap": ("ssgd", {"overlap": True, "bucket_mb": 0.001}, CLIP, 2),
    "cpu_acc": ("cpu_acc", {}, CLIP, 2),
    "ps_grad": ("ps_grad", {}, CLIP, 1),
    "gpi-accumulate": ("gpi", {}, None, 2),
    # an optimizer that writes its gradients: given private copies, never the shared slots
    "ssgd-nesterov": ("ssgd", {}, None, 1, "nesterov"),
    "cpu_acc-nesterov": ("cpu_acc", {}, None, 1, "nesterov"),
    "gpi-nesterov": ("gpi", {}, None, 1, "nesterov"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(CASES))
def test_adamw_with_clipping_and_micro_batches_equals_ddp(case: str) -> None:
    strategy, options, clip, k, *optimizer = CASES[case]
    payload = {"strategy": strategy, "options": options, "clip": clip, "accumulate": k,
               "optimizer": optimizer[0] if optimizer else "adamw"}
    results = launch("runtime.train.test_optimizers:against_ddp_worker", 2, payload, threads=1)
    for rank, result in enumerate(results):
        for step in range(STEPS):
            assert relative_error(result["ours"][step], result["ddp"][step]) < 1e-5, (case, rank, step)
    assert relative_error(results[0]["ddp"][0], results[0]["ddp"][-1]) > 1e-2  # the weights moved
    if clip is not None:
        assert results[0]["clipped"] > 0, "the clip must bite in some step, or the test shows nothing"


@pytest.mark.parametrize("foreach", [False, True])
def test_what_grad_safety_says_of_each_optimizer_holds_on_this_torch(foreach: bool) -> None:
    """The optimizers it calls read-only leave the gradient as it was after three steps
    (with weight decay, momentum, maximize); the Nesterov SGD it calls a writer does write
    it on the foreach path."""
    from shmtrain.strategies.optim.grad_safety import READ_ONLY, writes_gradients

    def step(cls: type, **kwargs: Any) -> tuple[bool, bool]:
        p = nn.Parameter(torch.randn(64))
        p.grad = torch.randn(64)
        before = p.grad.clone()
        optimizer = cls([p], lr=0.1, foreach=foreach, **kwargs)
        for _ in range(3):
            optimizer.step()
        return writes_gradients(optimizer), not torch.equal(p.grad, before)

    for cls in READ_ONLY:
        for kwargs in ({}, {"weight_decay": 0.1}, {"maximize": True}):
            if cls is torch.optim.Rprop and "weight_decay" in kwargs:
                continue
            said, wrote = step(cls, **kwargs)
            assert not wrote or said, (cls.__name__, kwargs)  # never a writer called read-only
            if cls is not torch.optim.SGD:
                assert not said, (cls.__name__, kwargs)
    said, wrote = step(torch.optim.SGD, momentum=0.9, nesterov=True)
    assert said and (wrote or not foreach)
    assert not step(torch.optim.SGD, momentum=0.9)[0]


def test_optimizer_names_and_arguments_are_resolved_or_refused() -> None:
    assert optimizer_kwargs("SGD", "", 0.1, None, 1e-4) == {"lr": 0.1, "weight_decay": 1e-4, "momentum": 0.9}
    kwargs = optimizer_kwargs("adamw", "betas=(0.9, 0.95); eps=1e-7", 3e-4, None, 0.05)
    assert kwargs == {"lr": 3e-4, "weight_decay": 0.05, "betas": (0.9, 0.95), "eps": 1e-7}
    with pytest.raises(ValueError, match=r"--optimizer 'nosuch' is not a torch.optim class; choose one of: sgd, adamw"):
        optimizer_kwargs("nosuch", "", 0.1, None, 0.0)
    with pytest.raises(ValueError, match=r"--momentum 0.5 with --optimizer adamw: AdamW takes no momentum.*betas"):
        optimizer_kwargs("adamw", "", 0.1, 0.5, 0.0)
    with pytest.raises(ValueError, match=r"--optimizer-args: AdamW takes no nesterov; it takes .*amsgrad"):
        optimizer_kwargs("adamw", "nesterov=True", 0.1, None, 0.0)
    with pytest.raises(ValueError, match=r"'betas' is not k=v|is not k=v"):
        optimizer_kwargs("adamw", "betas", 0.1, None, 0.0)
    with pytest.raises(ValueError, match=r"give --lr as the flag"):
        optimizer_kwargs("adamw", "lr=0.1", 0.1, None, 0.0)


class Options:
    optimizer, optimizer_args, lr, momentum, weight_decay = "RMSprop", "alpha=0.9", 0.01, 0.5, 0.0


def test_build_optimizer_takes_any_torch_optim_class() -> None:
    optimizer = build_optimizer(Options(), tiny_model().parameters())
    assert isinstance(optimizer, torch.optim.RMSprop)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["alpha"]) == (0.01, 0.5, 0.9)


@pytest.mark.parametrize(
    "args,words",
    [
        (["--optimizer", "nosuch"], ["--optimizer 'nosuch'", "adamw"]),
        (["--optimizer", "adamw", "--momentum", "0.9"], ["--momentum", "AdamW takes no momentum",
                                                         "leave --momentum out"]),
        (["--optimizer", "adamw", "--optimizer-args", "foo=1"], ["--optimizer-args", "takes no foo"]),
        (["--optimizer", "adamw", "--sharded-update"], ["--optimizer adamw with --sharded-update",
                                                        "use --optimizer sgd"]),
        (["--strategy", "gpi", "--grad-clip", "1"], ["--grad-clip 1.0 with --strategy gpi", "norm is known"]),
        (["--grad-clip", "0"], ["--grad-clip", "positive"]),
        (["--accumulate", "2", "--sub-batch", "2"], ["--accumulate 2", "--sub-batch 2", "drop one"]),
        (["--accumulate", "64", "--batch-size", "32"], ["--accumulate 64", "--batch-size 32"]),
    ],
)
def test_what_a_strategy_cannot_honour_is_refused(args: list[str], words: list[str], capsys) -> None:
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, (word, err)


@pytest.mark.timeout(150)
def test_cli_trains_with_adamw_clipping_and_micro_batches_and_checkpoints_its_state(tmp_path: Path) -> None:
    out = tmp_path / "r"
    args = ["train", "--workers", "2", "--iterations", "6", "--batch-size", "8", "--optimizer", "adamw",
            "--lr", "3e-3", "--weight-decay", "0.05", "--optimizer-args", "betas=(0.9, 0.95)",
            "--grad-clip", "1.0", "--accumulate", "2", "--out", str(out), "--no-progress", "--checkpoint-every", "3"]
    assert main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 6
    config = (out / "config.toml").read_text()
    assert 'optimizer = "adamw"' in config and "grad-clip = 1.0" in config and "accumulate = 2" in config
    state = torch.load(next(out.glob("checkpoints/step-6/rank-0*")), weights_only=False)
    optimizer = state["optimizer"]
    assert optimizer["param_groups"][0]["betas"] == (0.9, 0.95)
    assert "exp_avg" in next(iter(optimizer["state"].values()))


@pytest.mark.timeout(150)
def test_a_model_of_ones_own_trains_and_resumes_from_the_cli(tmp_path: Path, monkeypatch) -> None:
    """--model module:callable with --model-args: built in every worker, in config.toml,
    and a resumed run continues it."""
    monkeypatch.chdir(ROOT)  # examples/ is importable from the root
    out = tmp_path / "own"
    args = ["train", "--model", "examples.mynet:Net", "--model-args", "width=8", "--workers", "2",
            "--batch-size", "8", "--optimizer", "adamw", "--lr", "3e-3", "--out", str(out), "--no-progress"]
    assert main([*args, "--iterations", "4"]) == 0
    config = (out / "config.toml").read_text()
    assert 'model = "examples.mynet:Net"' in config and 'model-args = "width=8"' in config
    weights = torch.load(out / "model.pt")
    assert weights["features.0.weight"].shape == (8, 1, 3, 3) and weights["head.weight"].shape == (10, 16)
    assert main(["train", "--resume", str(out), "--iterations", "6", "--no-progress"]) == 0
    assert json.loads((out / "summary.json").read_text())["iterations"] == 6


@pytest.mark.parametrize(
    "args,words",
    [
        (["--model", "nosuchmodule:Net"], ["--model 'nosuchmodule:Net'", "cannot import nosuchmodule", "PYTHONPATH"]),
        (["--model", "examples.mynet:Nope"], ["examples.mynet has no Nope"]),
        (["--model", "examples.mynet:Net", "--model-args", "width"], ["--model-args 'width'", "is not k=v"]),
        (["--model", "smallcnn", "--model-args", "width=2"], ["--model-args 'width=2' with --model smallcnn",
                                                              "takes no arguments"]),
    ],
)
def test_a_bad_model_spec_is_named(args: list[str], words: list[str], capsys, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, (word, err)
