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


@pytest.mark.timeout(150)
def test_a_resumed_run_sums_its_stretches_and_keeps_their_logs(tmp_path: Path) -> None:
    """Each launch on a run folder is a stretch (``runtime/outputs/stretches.py``): summary.json's
    wall_s is their sum and lists them; resuming a finished run at its total adds a stretch
    of no iterations and no second evaluation row."""
    out = tmp_path / "run"
    base = ["--workers", "2", "--model", "mlp", "--data", "synthetic", "--samples", "256", "--input-shape",
            "1x8x8", "--batch-size", "8", "--checkpoint-every", "10", "--eval-every", "10", "--no-progress"]
    assert main(["train", *base, "--iterations", "20", "--out", str(out)]) == 0
    first = json.loads((out / "summary.json").read_text())
    assert [(s["start_iteration"], s["end_iteration"], s["ended"]) for s in first["stretches"]] == [(0, 20, "finished")]
    assert main(["train", "--resume", str(out)]) == 0  # at its total: nothing to train
    again = json.loads((out / "summary.json").read_text())
    assert again["evaluations"] == first["evaluations"] == 2
    evals = [r for r in (out / "metrics" / "rank-0.jsonl").read_text().splitlines() if '"eval"' in r]
    assert len(evals) == 2  # the last evaluation row is not written twice
    assert [(s["start_iteration"], s["end_iteration"]) for s in again["stretches"]] == [(0, 20), (20, 20)]
    assert main(["train", "--resume", str(out), "--iterations", "30"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    stretches = summary["stretches"]
    assert [(s["stretch"], s["start_iteration"], s["end_iteration"], s["ended"]) for s in stretches] == [
        (1, 0, 20, "finished"), (2, 20, 20, "finished"), (3, 20, 30, "finished")]
    assert summary["wall_s"] == pytest.approx(sum(s["wall_s"] for s in stretches), abs=0.01)
    assert summary["wall_s"] > stretches[0]["wall_s"] and all(s["started_at"] for s in stretches)
    assert summary["iterations_per_rank"] == {"0": 30, "1": 30}
    log = (out / "logs" / "rank-1.log").read_text()
    assert [log.count(f"--- stretch {k}: started") for k in (1, 2, 3)] == [1, 1, 1]
    assert "from iteration 20 ---" in log


def test_a_stretch_whose_launch_was_killed_is_listed_and_closed_by_the_next(tmp_path: Path) -> None:
    """A launch killed before it could end its stretch (rank 0 of a torchrun job under its
    restarts, a launcher by SIGKILL) is still in stretches.json: the next launch closes
    it as failed, at rank 0's last row, with the time up to that row."""
    from shmtrain.runtime.outputs import stretches

    (tmp_path / "metrics").mkdir()
    killed = stretches.Stretch(tmp_path, 0)
    assert [e["ended"] for e in stretches.read(tmp_path)] == ["running"]
    rows = [{"iteration": i, "loss": 1.0, "t0": killed.epoch0 + 0.5 * i} for i in (1, 2, 3)]
    (tmp_path / "metrics" / "rank-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # ... killed here: nothing ends it; the next launch resumes from iteration 2's checkpoint
    second = stretches.Stretch(tmp_path, 2)
    second.end("finished", 5)
    entries = stretches.read(tmp_path)
    assert [(e["stretch"], e["start_iteration"], e["end_iteration"], e["ended"]) for e in entries] == [
        (1, 0, 3, "failed"), (2, 2, 5, "finished")]
    assert entries[0]["wall_s"] == pytest.approx(1.5, abs=0.01)
    summary: dict = {}
    stretches.apply(tmp_path, summary)
    assert summary["wall_s"] == pytest.approx(1.5 + entries[1]["wall_s"], abs=0.01)
