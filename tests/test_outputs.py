"""What a run leaves for its user: an asynchronous job's model.pt is the global weights
(W_g, the model the method converges to), rank 0's own beside it; summary.json says
which, with both accuracies, and how many iterations each rank did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shmtrain.cli import main


@pytest.mark.timeout(150)
def test_an_asynchronous_run_exports_the_global_weights(tmp_path: Path) -> None:
    out = tmp_path / "r"
    assert main(["train", "--strategy", "seasgd", "--workers", "2", "--model", "mlp", "--iterations", "30",
                 "--batch-size", "16", "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model_pt"].startswith("global weights")
    assert 0.0 <= summary["accuracy_rank0_local"] <= 1.0 and 0.0 <= summary["accuracy"] <= 1.0
    assert set(summary["iterations_per_rank"]) == {"0", "1"}
    glob, local = torch.load(out / "model.pt"), torch.load(out / "model-rank0.pt")
    assert glob.keys() == local.keys()
    # W_g is the elastic average of both workers, not rank 0's copy
    assert any(not torch.equal(glob[k], local[k]) for k in glob)


@pytest.mark.timeout(120)
def test_a_synchronous_run_writes_one_model(tmp_path: Path) -> None:
    out = tmp_path / "s"
    assert main(["train", "--workers", "2", "--model", "mlp", "--iterations", "5", "--out", str(out),
                 "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy_rank0_local"] is None and "same on every worker" in summary["model_pt"]
    assert (out / "model.pt").exists() and not (out / "model-rank0.pt").exists()
