"""``--amp bf16|fp16``: forward and loss under torch.autocast, float32
weights and gradients (what the strategies' buffers hold), also in the sub-batch threads
(bf16); fp16 with a GradScaler whose decisions every rank shares (the gradients it checks
are the reduced ones), refused with the option named where the update cannot take one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from shmtrain.runtime.train.trainer import Trainer
from shmtrain.timing import PhaseTimer

pytestmark = pytest.mark.timeout(120)


class _Plain:
    """The three calls a Trainer needs, on a bare model and optimizer."""

    def __init__(self, model: nn.Module) -> None:
        self.module = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def before_forward(self) -> None:
        pass

    def step(self) -> None:
        self.optimizer.step()


def _model_and_dtypes() -> tuple[nn.Module, list[torch.dtype]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    return model, seen


@pytest.mark.parametrize("sub_batch", [1, 2])
def test_bf16_autocasts_the_forward_and_keeps_float32_weights_and_gradients(sub_batch: int) -> None:
    model, seen = _model_and_dtypes()
    engine = _Plain(model)
    trainer = Trainer(engine, nn.CrossEntropyLoss(), PhaseTimer(), sub_batch=sub_batch, amp="bf16")
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    grads = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda q: grads.append(q.grad.dtype))
    loss = trainer.step(x, y)
    trainer.close()
    assert seen and all(d == torch.bfloat16 for d in seen), seen  # every part's forward, each thread
    assert loss.dtype == torch.float32
    assert grads and all(d == torch.float32 for d in grads)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_float32_is_the_default() -> None:
    model, seen = _model_and_dtypes()
    Trainer(_Plain(model), nn.CrossEntropyLoss(), PhaseTimer()).step(torch.randn(4, 16), torch.randint(0, 4, (4,)))
    assert seen == [torch.float32]


def fp16_worker(ctx, payload: dict) -> dict:
    """Three fp16 steps of ``ssgd``, then one where rank 1's batch overflows: every rank
    must skip that step (same weights as before it) and halve its scale."""
    from shmtrain.parallel.data_parallel import DataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dp = DataParallel(model, opt, payload["strategy"], ctx=ctx, **payload.get("options", {}))
    trainer = Trainer(dp, nn.CrossEntropyLoss(), PhaseTimer(), amp="fp16")
    gen = torch.Generator().manual_seed(ctx.rank)
    weights, scales = [], []
    for step in range(4):
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        if step == 3 and ctx.rank == 1:
            x[0, 0] = float("inf")
        trainer.step(x, y)
        weights.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
        scales.append(trainer.scaler.get_scale())
    state = trainer.state_dict()  # a checkpoint holds the loss scale, and a resume restores it
    trainer.scaler.update(new_scale=1.0)
    trainer.load_state_dict(state)
    dp.close()
    return {"weights": weights, "scales": scales, "dtypes": sorted({str(d) for d in seen}),
            "saved_scale": state["scaler"]["scale"], "restored_scale": trainer.scaler.get_scale()}


@pytest.mark.parametrize("strategy,options", [("ssgd", {}), ("cpu_acc", {}), ("ssgd", {"overlap": True})])
def test_fp16_ranks_agree_on_a_skipped_step(strategy: str, options: dict) -> None:
    from shmtrain.runtime.launch.launcher import launch

    results = launch("runtime.train.test_amp:fp16_worker", 2, {"strategy": strategy, "options": options}, timeout=100)
    a, b = results
    assert a["dtypes"] == ["torch.float16"]
    for step in range(4):
        assert torch.equal(a["weights"][step], b["weights"][step]), f"step {step}: the ranks' weights differ"
    assert not torch.equal(a["weights"][0], a["weights"][1])  # normal steps move the weights
    assert torch.equal(a["weights"][3], a["weights"][2])  # the overflowing step is skipped by both
    for r in results:
        assert r["scales"][3] == r["scales"][2] / 2 and r["scales"][0] > 1
        assert r["saved_scale"] == r["restored_scale"] == r["scales"][3]


def test_fp16_is_refused_where_the_update_cannot_take_a_scaler() -> None:
    from shmtrain import strategies

    for name, why in (("gpi", "the root updates layer by layer"), ("ps_grad", "only the server steps")):
        cls = strategies.get(name)
        with pytest.raises(ValueError, match=rf"--amp fp16 with --strategy {name}: {why}.*use --amp bf16"):
            cls.check_fp16(cls.Config())
    with pytest.raises(ValueError, match=r"--amp fp16 steps the optimizer through a GradScaler, which a "
                                         r"_Plain cannot take"):
        Trainer(_Plain(nn.Linear(2, 2)), nn.CrossEntropyLoss(), PhaseTimer(), amp="fp16")


@pytest.mark.slow  # ~60 s of CPU: 10 epochs twice; bf16's exactness runs by default
def test_bf16_trains_to_within_one_point_of_float32(tmp_path: Path) -> None:
    accuracy = {}
    for amp in ("none", "bf16"):
        subprocess.run([sys.executable, "-m", "shmtrain", "train", "--epochs", "10", "--workers", "2", "--amp", amp,
                        "--no-progress", "--out", str(tmp_path / amp)], check=True, capture_output=True, timeout=100)
        accuracy[amp] = json.loads((tmp_path / amp / "summary.json").read_text())["accuracy"]
    assert accuracy["none"] > 0.9
    assert abs(accuracy["bf16"] - accuracy["none"]) <= 0.01, accuracy


def test_an_fp16_overflow_at_the_first_iteration_says_float16_not_the_learning_rate(tmp_path: Path) -> None:
    from conftest import run_main

    done = run_main("train", "--amp", "fp16", "--model", "support.odd_models:loud", "--workers", "2",
                    "--iterations", "5", "--no-progress", "--out", str(tmp_path / "run"))
    assert done.returncode == 1, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert "loss at iteration 1 is " in line and "float16, which holds numbers up to 65504" in line, line
    assert "--amp bf16" in line and "no update has been made yet" in line and "lower --lr" not in line, line
