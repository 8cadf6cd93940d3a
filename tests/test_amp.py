"""``--amp bf16`` (issue 14, item 4, the CPU part): forward and loss under torch.autocast
in bfloat16, float32 weights and gradients (what the strategies' buffers hold), also in
the sub-batch threads; fp16 refused on the CPU with the option named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from shmtrain.runtime.trainer import Trainer
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


def test_fp16_on_the_cpu_is_refused_naming_the_option(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "shmtrain", "train", "--amp", "fp16", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--amp 'fp16'" in proc.stderr and "use --amp bf16" in proc.stderr


def test_bf16_trains_to_within_one_point_of_float32(tmp_path: Path) -> None:
    accuracy = {}
    for amp in ("none", "bf16"):
        subprocess.run([sys.executable, "-m", "shmtrain", "train", "--epochs", "10", "--workers", "2", "--amp", amp,
                        "--no-progress", "--out", str(tmp_path / amp)], check=True, capture_output=True, timeout=100)
        accuracy[amp] = json.loads((tmp_path / amp / "summary.json").read_text())["accuracy"]
    assert accuracy["none"] > 0.9
    assert abs(accuracy["bf16"] - accuracy["none"]) <= 0.01, accuracy
