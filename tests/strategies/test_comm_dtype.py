"""``ssgd --comm-dtype bf16``: the gradient allreduce in bfloat16 (half
the bytes in the slots and between hosts), float32 weights, gradients and optimizer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from shmtrain.strategies.base import build_config

pytestmark = pytest.mark.timeout(120)


def _train(out: Path, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "shmtrain", "train", "--workers", "2", "--no-progress", *args,
                    "--out", str(out)], check=True, capture_output=True, timeout=100)


def test_the_slots_are_bfloat16_and_the_gradients_float32() -> None:
    from shmtrain.parallel.data_parallel import DataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    dp = DataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1), "ssgd", comm_dtype="bf16")
    try:
        assert type(dp.strategy).__name__ == "CastSSGD"
        assert dp.strategy.allreduce.input(1).dtype == torch.bfloat16
        dp.zero_grad()
        nn.functional.cross_entropy(dp(torch.randn(4, 8)), torch.tensor([0, 1, 0, 1])).backward()
        dp.step()
        assert all(p.grad.dtype == torch.float32 and p.dtype == torch.float32 for p in model.parameters())
    finally:
        dp.close()


def test_one_step_is_sgd_on_the_gradient_rounded_to_bfloat16() -> None:
    """In one process: the step is SGD's with each gradient rounded to bfloat16 and back,
    bit for bit, and not the float32 step (the bfloat16 path ran)."""
    from shmtrain.parallel.data_parallel import DataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    reference = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    reference.load_state_dict(model.state_dict())
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 0, 1])
    dp = DataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1), "ssgd", comm_dtype="bf16")
    try:
        dp.zero_grad()
        nn.functional.cross_entropy(dp(x), y).backward()
        dp.step()
    finally:
        dp.close()
    nn.functional.cross_entropy(reference(x), y).backward()
    rounded_any = False
    for p in reference.parameters():
        rounded = p.grad.to(torch.bfloat16).float()
        rounded_any |= not torch.equal(rounded, p.grad)
        p.grad = rounded
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert rounded_any  # bfloat16 loses bits of these gradients: the comparison can tell
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got, want)


@pytest.mark.slow  # ~12 s: two CLI runs of 2 workers; the rounded step in one process by default above
def test_one_step_is_that_of_float32_to_bfloat16_rounding(tmp_path: Path) -> None:
    for dtype in ("fp32", "bf16"):
        _train(tmp_path / dtype, "--iterations", "1", "--comm-dtype", dtype)
    a, b = (torch.load(tmp_path / d / "model.pt") for d in ("fp32", "bf16"))
    errors = [float((a[k] - b[k]).norm() / a[k].norm()) for k in a if a[k].dtype.is_floating_point]
    assert max(errors) < 1e-3  # the update differs by the rounding of the averaged gradient
    assert max(errors) > 0  # and it does differ: the bfloat16 path ran


@pytest.mark.slow  # ~23 s of CPU: a run to accuracy; one bf16 step's rounding runs by default
def test_bf16_averaging_trains_to_within_one_point(tmp_path: Path) -> None:
    accuracy = {}
    for dtype in ("fp32", "bf16"):
        _train(tmp_path / dtype, "--epochs", "10", "--comm-dtype", dtype)
        accuracy[dtype] = json.loads((tmp_path / dtype / "summary.json").read_text())["accuracy"]
    assert accuracy["fp32"] > 0.9 and abs(accuracy["bf16"] - accuracy["fp32"]) <= 0.01, accuracy


@pytest.mark.parametrize("other", [{"overlap": True}, {"sharded_update": True}])
def test_bf16_with_overlap_or_the_sharded_update_is_refused(other: dict) -> None:
    with pytest.raises(ValueError, match="--comm-dtype bf16 with --(overlap|sharded-update)"):
        build_config("ssgd", {"comm_dtype": "bf16", **other})
