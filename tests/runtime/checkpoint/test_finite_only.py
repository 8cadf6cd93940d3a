"""Only finite checkpoints are committed: a NaN gradient on one rank (its loss finite)
leaves ``latest`` at the last finite checkpoint, and ``--max-restarts`` does not restart
the run into the same divergence: it stops, naming the iteration, the rank and that
checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_main
from shmtrain.runtime.train.finite import first_non_finite

JOB = ["--workers", "2", "--model", "support.odd_models:nan_gradient", "--model-args", "rank=1; after=40",
       "--data", "synthetic", "--samples", "256", "--input-shape", "1x8x8", "--batch-size", "8",
       "--iterations", "100", "--checkpoint-every", "10", "--keep-checkpoints", "0", "--max-restarts", "3",
       "--timeout", "30", "--no-progress"]


@pytest.mark.parametrize("strategy", ["ssgd", "diloco"])
def test_a_nan_gradient_is_never_checkpointed_nor_restarted_into(tmp_path: Path, strategy: str) -> None:
    out = tmp_path / "run"
    extra = ["--sync-every", "5"] if strategy == "diloco" else []
    done = run_main("train", "--strategy", strategy, *extra, *JOB, "--out", str(out))
    assert done.returncode == 1, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    folder = out / "checkpoints"
    latest = (folder / "latest").read_text().strip()
    assert int(latest.removeprefix("step-")) < 40 or strategy == "diloco", latest
    assert "restarting" not in done.stderr and "restart 1 of 3" not in done.stderr, done.stderr
    assert "the training diverged: rank " in line and "not restarted" in line, line
    assert "iteration 40" in line or "iteration 41" in line, line
    assert str(folder / latest) in line, line
    for step in folder.glob("step-*"):  # every checkpoint written is finite
        assert not step.name.endswith(".tmp"), step
        meta = json.loads((step / "meta.json").read_text())
        for rank in range(meta["world"]):
            state = torch.load(step / f"rank-{rank}.pt", weights_only=True)
            assert first_non_finite({k: state[k] for k in ("model", "optimizer", "strategy")}) is None, step
