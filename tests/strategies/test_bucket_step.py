"""``ssgd --overlap``, staged: the optimizer steps each bucket's parameters once its mean
has landed (``strategies/optim/partial_step.py``), with the weights and optimizer state of one
step after backward, bit for bit; the cases that need every gradient first step once.

On the CPU in the staged copy mode (``SHMTRAIN_STAGING=copy``): the GPU data flow, the
courier thread included.
"""

from __future__ import annotations

import hashlib
import os
import threading
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from shmtrain.runtime.launch.launcher import launch
from shmtrain.strategies.layout.staging import STAGING_ENV
from shmtrain.strategies.optim.partial_step import (
    PER_PARAMETER,
    optimizer_reason,
    split_groups,
    step_part,
    whole_step_reason,
)

#: one setting per listed class, the state each keeps per parameter exercised
SETTINGS: dict[type[torch.optim.Optimizer], dict[str, Any]] = {
    torch.optim.SGD: {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4, "nesterov": True},
    torch.optim.Adam: {"lr": 0.01, "weight_decay": 1e-4, "amsgrad": True},
    torch.optim.AdamW: {"lr": 0.01},
    torch.optim.RMSprop: {"lr": 0.01, "momentum": 0.5, "centered": True},
    torch.optim.Adagrad: {"lr": 0.1},
    torch.optim.Adamax: {"lr": 0.01},
    torch.optim.NAdam: {"lr": 0.01, "decoupled_weight_decay": True, "weight_decay": 1e-3},
    torch.optim.RAdam: {"lr": 0.01},
    torch.optim.Adadelta: {"lr": 1.0},
    torch.optim.ASGD: {"lr": 0.01, "t0": 1},
    torch.optim.Rprop: {"lr": 0.01},
}
OVERLAP = {"overlap": True, "bucket_mb": 0.01}  # 10 kB buckets: each 64x64 weight its own


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64),
                         nn.Tanh(), nn.Linear(64, 4))


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two groups with different learning rates (a part may hold parameters of both)."""
    params = list(model.parameters())
    return [{"params": params[::2]}, {"params": params[1::2], "lr": 0.003}]


def _digest(model: nn.Module) -> str:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    return hashlib.sha1(flat.numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("cls", sorted(PER_PARAMETER, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_each_listed_optimizer_stepped_in_parts_equals_one_step(cls: type[torch.optim.Optimizer]) -> None:
    """The allow-list's claim on the installed torch: stepping disjoint parts in any order
    gives the bits and the state of one step, and the optimizer's groups stay whole."""
    whole, parts = _net(), _net()
    opt_whole, opt_parts = cls(_groups(whole), **SETTINGS[cls]), cls(_groups(parts), **SETTINGS[cls])
    assert optimizer_reason(opt_parts) is None
    params = list(parts.parameters())
    part_of = {id(p): i % 3 for i, p in enumerate(params)}
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        for p, q in zip(whole.parameters(), params, strict=True):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt_whole.step()
        split = split_groups(opt_parts, part_of, 3)
        for part in (2, 0, 1):
            before = [p.detach().clone() for p in params]
            step_part(opt_parts, split[part])
            moved = {part_of[id(p)] for p, b in zip(params, before, strict=True) if not torch.equal(p, b)}
            assert moved <= {part}, f"{cls.__name__}: stepping part {part} moved parts {moved}"
        assert [len(g["params"]) for g in opt_parts.param_groups] == [4, 4]
    assert _digest(whole) == _digest(parts), f"{cls.__name__}: per-part steps differ from one step"
    a, b = opt_whole.state_dict(), opt_parts.state_dict()
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    for key, state in a["state"].items():
        for name, value in state.items():
            other = b["state"][key][name]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, (cls, name)


def test_what_cannot_step_in_parts_says_why() -> None:
    model = _net()

    class MySGD(torch.optim.SGD):
        pass

    assert "MySGD is not known" in optimizer_reason(MySGD(model.parameters(), lr=0.1))
    assert "differentiable" in optimizer_reason(torch.optim.SGD(model.parameters(), lr=0.1, differentiable=True))
    hooked = torch.optim.Adam(model.parameters())
    handle = hooked.register_step_post_hook(lambda *_: None)
    assert "step hooks" in optimizer_reason(hooked)
    handle.remove()
    assert optimizer_reason(hooked) is None
    hooked.step = lambda *a, **k: None  # a user's own replacement would be bypassed
    assert "replaced on the instance" in optimizer_reason(hooked)
    scheduled = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(scheduled, 1)  # wraps step on the instance: allowed, and told
    assert optimizer_reason(scheduled) is None
    scheduled._opt_called = False
    step_part(scheduled, split_groups(scheduled, {id(p): 0 for p in model.parameters()}, 1)[0])
    assert scheduled._opt_called is True


def test_the_loop_clipping_and_loss_scaling_keep_the_one_step() -> None:
    """:func:`whole_step_reason`: the loop's own reason first, then --grad-clip, --amp fp16,
    then the optimizer's."""
    model = _net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy = SimpleNamespace(whole_step_reason=None, grad_clip=None, scaler=None, optimizer=sgd)
    assert whole_step_reason(strategy) is None
    strategy.scaler = torch.amp.GradScaler("cpu")
    assert whole_step_reason(strategy).startswith("--amp fp16: the GradScaler unscales")
    strategy.grad_clip = 1.0
    assert whole_step_reason(strategy).startswith("--grad-clip 1.0: the clipping coefficient")
    strategy.whole_step_reason = "--sub-batch 2: the parts' threads"
    assert whole_step_reason(strategy) == "--sub-batch 2: the parts' threads"


def _train(ctx, optimizer: str, steps: int, **kw: Any) -> dict[str, Any]:
    """Train the net ``steps`` iterations with ssgd --overlap staged; the weights' digest
    per step and what the strategy did (events: landings and steps, with their thread).
    ``trainer``: through the Trainer, with a learning-rate schedule and --accumulate 2."""
    from shmtrain.parallel.data_parallel import DataParallel
    from shmtrain.runtime.train.trainer import Trainer

    device = torch.device(kw.pop("device", "cpu"))
    model = _net().to(device)
    opt = {"sgd": lambda: torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4),
           "adam": lambda: torch.optim.Adam(model.parameters(), lr=0.01),
           "mysgd": lambda: type("MySGD", (torch.optim.SGD,), {})(model.parameters(), lr=0.05)}[optimizer]()
    single, through_trainer = kw.pop("single", False), kw.pop("trainer", False)
    dp = DataParallel(model, opt, "ssgd", ctx=ctx, ddp_style=kw.pop("ddp_style", False),
                      **OVERLAP, **kw)
    strategy = dp.strategy
    trainer = None
    if through_trainer:
        schedule = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
        trainer = Trainer(dp, nn.CrossEntropyLoss(), dp.timer, scheduler=schedule, accumulate=2)
    if single:  # the reference: the loop's own reason for the one step after backward
        strategy.whole_step_reason = "reference"
    events: list[tuple] = []
    start: list[list[torch.Tensor]] = []
    buckets = [[strategy.order[i] for i in g] for g in strategy._groups]

    def record(name: str) -> None:
        original = getattr(strategy, name)

        def wrapped(bucket: int) -> None:
            original(bucket)
            # which buckets' weights moved since the iteration began (after a step)
            moved = [b for b, ps in enumerate(buckets)
                     if any(not torch.equal(p, s) for p, s in zip(ps, start[b], strict=True))]
            events.append((name, bucket, threading.get_ident(), moved))

        setattr(strategy, name, wrapped)

    record("_copy_back")
    record("_step_bucket")
    gen = torch.Generator().manual_seed(1)
    digests, iterations, details = [], [], []
    for _ in range(steps):
        x = torch.randn((2 * 6, 8), generator=gen).to(device)
        y = torch.randint(0, 4, (2 * 6,), generator=gen).to(device)
        mine = slice(ctx.rank * 6, (ctx.rank + 1) * 6)
        start[:] = [[p.detach().clone() for p in ps] for ps in buckets]
        events.clear()
        if trainer is not None:
            trainer.step((x[mine], y[mine]))
        else:
            opt.zero_grad() if dp.ddp_style else dp.zero_grad()
            nn.functional.cross_entropy(dp(x[mine]), y[mine]).backward()
            events.append(("backward-returned", -1, threading.get_ident(), []))
            opt.step() if dp.ddp_style else dp.step()
        iterations.append(list(events))
        details.append(dp.timer.take_details())
        digests.append(_digest(model))
    state = hashlib.sha1(repr(opt.state_dict()["param_groups"]).encode()).hexdigest()
    result = {"digests": digests, "events": iterations, "reason": strategy.bucket_step_reason,
              "details": details, "main": threading.get_ident(), "buckets": len(buckets), "groups": state,
              "state": _state(opt), "lr": opt.param_groups[0]["lr"]}
    dp.close()
    return result


def _state(opt: torch.optim.Optimizer) -> dict[int, str]:
    """Per parameter index of ``state_dict()``, a digest of its state (the per-bucket steps
    fill ``state`` in bucket order: the same keys, in another insertion order)."""
    state = opt.state_dict()["state"]
    return {key: hashlib.sha1(b"".join(v.numpy().tobytes() if torch.is_tensor(v) else repr(v).encode()
                                       for _, v in sorted(state[key].items()))).hexdigest() for key in sorted(state)}


def equality_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    """Per optimizer: per-bucket steps and the one step; then the fallback cases."""
    os.environ[STAGING_ENV] = "copy"
    out = {}
    for optimizer in ("sgd", "adam", "trainer"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out[optimizer] = {mode: _train(ctx, "sgd" if optimizer == "trainer" else optimizer, payload["steps"],
                                           single=mode == "single", trainer=optimizer == "trainer")
                              for mode in ("bucket", "single")}
        out[optimizer]["warnings"] = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    out["clip"] = _train(ctx, "sgd", 2, grad_clip=0.5)
    out["mysgd"] = _train(ctx, "mysgd", 2)
    out["ddp_style"] = _train(ctx, "sgd", 2, ddp_style=True)
    return out


def _steps(events: list[tuple]) -> list[int]:
    return [e[1] for e in events if e[0] == "_step_bucket"]


def test_per_bucket_steps_equal_one_step_and_fallbacks_take_one_step() -> None:
    """2 workers, staged: SGD with momentum and Adam stepped per bucket hold the bits of
    the one step after backward every iteration (and equal state), and so does SGD through
    the Trainer with a learning-rate schedule and --accumulate 2 (no scheduler warning:
    it sees the steps); --grad-clip, an
    optimizer not on the list and the DDP-style loop step once, saying why."""
    results = launch("strategies.test_bucket_step:equality_worker", 2, {"steps": 4}, timeout=150)
    for rank, result in enumerate(results):
        for optimizer in ("sgd", "adam", "trainer"):
            bucket, single = result[optimizer]["bucket"], result[optimizer]["single"]
            assert not result[optimizer]["warnings"] and bucket["lr"] == single["lr"]
            assert bucket["reason"] is None and single["reason"] == "reference"
            assert bucket["buckets"] >= 4
            assert bucket["digests"] == single["digests"], f"rank {rank} {optimizer}: per-bucket weights differ"
            assert bucket["state"] == single["state"] and bucket["groups"] == single["groups"]
            assert bucket["details"][0]["optimizer_step"] == f"per bucket ({bucket['buckets']} buckets)"
            assert all(0 <= d["buckets_stepped_early"] <= bucket["buckets"] for d in bucket["details"])
            assert single["details"][0]["optimizer_step"] == "after backward (reference)"
            for events in bucket["events"]:  # every bucket stepped once, each after its landing
                assert sorted(_steps(events)) == list(range(bucket["buckets"]))
                for b in range(bucket["buckets"]):
                    kinds = [(e[0], e[1]) for e in events]
                    assert kinds.index(("_copy_back", b)) < kinds.index(("_step_bucket", b))
            assert all(not _steps(events) for events in single["events"])
        assert results[0]["sgd"]["bucket"]["digests"] == result["sgd"]["bucket"]["digests"]
        for case, words in (("clip", "--grad-clip 0.5: the clipping coefficient is the global norm"),
                            ("mysgd", "optimizer MySGD is not known to update each parameter"),
                            ("ddp_style", "the DDP-style loop")):
            run = result[case]
            assert words in run["reason"] and words in run["details"][0]["optimizer_step"], (case, run["reason"])
            assert all(not _steps(events) for events in run["events"]), f"{case}: a per-bucket step ran"
            assert run["digests"][0] != run["digests"][1]  # it did step


def order_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    from shmtrain.parallel.data_parallel import DataParallel
    from shmtrain.runtime.train.trainer import Trainer

    os.environ[STAGING_ENV] = "copy"
    result = _train(ctx, "sgd", 1)
    model = _net()  # --sub-batch: the Trainer gives the strategy its reason
    dp = DataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1), "ssgd", ctx=ctx, **OVERLAP)
    trainer = Trainer(dp, nn.CrossEntropyLoss(), dp.timer, sub_batch=2)
    result["sub_batch"] = whole_step_reason(dp.strategy)
    trainer.close()
    dp.close()
    return result


def test_each_bucket_steps_as_its_mean_lands_before_the_last_lands() -> None:
    """One worker (a bucket is reduced as soon as it is launched, so the order is fixed):
    on the courier, bucket k's landing, then its step, which moves bucket k's weights
    only, before bucket k+1 lands; every step before the last landing but the last's."""
    result = launch("strategies.test_bucket_step:order_worker", 1, {}, timeout=90)[0]
    events, n = result["events"][0], result["buckets"]
    pairs = [(e[0], e[1]) for e in events if e[0] != "backward-returned"]
    assert pairs == [(kind, b) for b in range(n) for kind in ("_copy_back", "_step_bucket")], pairs
    for e in events:
        if e[0] == "_step_bucket":  # bucket k stepped: buckets 0..k moved, the later ones not yet
            assert e[1:2] and e[3] == list(range(e[1] + 1)), e
            assert e[2] != result["main"], "a per-bucket step ran on the training thread"
    assert result["sub_batch"].startswith("--sub-batch 2: the parts' threads run copies"), result["sub_batch"]


def cuda_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    """On the GPU (every worker on GPU 0): per-bucket steps and the one step."""
    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    modes = ("bucket", "single")
    return {optimizer: {mode: _train(ctx, optimizer, 3, single=mode == "single", device="cuda:0")["digests"]
                        for mode in modes} for optimizer in ("sgd", "adam")}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_per_bucket_steps_on_cuda_equal_one_step() -> None:
    """The stream-ordered per-bucket step (after a stream wait for the copies back) holds
    the one step's bits on a GPU too (foreach kernels on both paths)."""
    for rank, result in enumerate(launch("strategies.test_bucket_step:cuda_worker", 2, {}, timeout=170)):
        for optimizer, runs in result.items():
            assert runs["bucket"] == runs["single"], f"rank {rank} {optimizer}: per-bucket weights differ on cuda"
