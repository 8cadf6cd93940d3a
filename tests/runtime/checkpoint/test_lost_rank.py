"""Checkpoints of an asynchronous run that trains on without a killed worker: the
survivors keep checkpointing (the lost rank's last state carried on), ``latest``
advances to the run's end, no ``.tmp`` folder is left, and ``--resume`` continues the
survivors from their own last iteration, the lost rank from its last checkpoint."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import torch

from conftest import worker_process
from support.runs import iterations_logged, rows_written, start, train, wait_for

JOB = ["--strategy", "seasgd", "--workers", "3", "--model", "mlp", "--data", "synthetic", "--samples", "256",
       "--input-shape", "1x8x8", "--batch-size", "8", "--no-progress", "--checkpoint-every", "100",
       "--timeout", "60"]


def test_a_killed_async_worker_leaves_complete_checkpoints_and_a_resume_goes_on(tmp_path: Path) -> None:
    out = tmp_path / "run"
    launcher = start([*JOB, "--iterations", "1500", "--out", str(out)])
    try:
        wait_for(lambda: (out / "checkpoints" / "step-100").exists() and rows_written(out, 2) > 150, launcher,
                 "rank 2's first checkpoint")
        os.kill(worker_process(launcher.pid, 2).pid, signal.SIGKILL)
        _, err = launcher.communicate(timeout=150)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == 1 and "worker rank 2" in err and "SIGKILL" in err, err
    folder = out / "checkpoints"
    assert not list(folder.glob("*.tmp")), sorted(p.name for p in folder.iterdir())
    latest = (folder / "latest").read_text().strip()
    final = int(latest.removeprefix("step-"))
    assert final >= 1500, latest  # the survivors' final checkpoint, not one from before the kill
    meta = json.loads((folder / latest / "meta.json").read_text())
    kept = meta["ranks"][2]["lost"]["state_of"]
    assert kept >= 100 and kept % 100 == 0 and meta["ranks"][2]["iteration"] == kept
    logs = (out / "logs" / "rank-0.log").read_text() + (out / "logs" / "rank-1.log").read_text()
    assert "worker rank 2 is lost; checkpoint step-" in logs
    assert torch.load(folder / latest / "rank-2.pt", weights_only=True)["train"]["iteration"] == kept
    ends = {}
    for rank in (0, 1):
        ends[rank] = iterations_logged(out, rank)[-1]
        state = torch.load(folder / latest / f"rank-{rank}.pt", weights_only=True)
        assert state["train"]["iteration"] == meta["ranks"][rank]["iteration"] == ends[rank] > kept
    # the resume: each rank from its own place (the survivors from where they ended)
    assert train(*JOB, "--iterations", str(max(ends.values()) + 50), "--resume", str(out)) == 0
    for rank in (0, 1):
        resumed = iterations_logged(out, rank)
        assert resumed[resumed.index(ends[rank]) + 1] == ends[rank] + 1 and resumed == sorted(set(resumed))
    rows = iterations_logged(out, 2)
    assert rows[rows.index(kept) + 1] == kept + 1 and rows == sorted(set(rows))


class _Trainer:
    """What Checkpointer.save reads of a Trainer: its state (weights, iteration)."""

    def __init__(self, value: float, iteration: int) -> None:
        self.value, self.iteration = value, iteration

    def state_dict(self, copy: bool = True) -> dict:
        return {"model": {"w": torch.full((4,), self.value)}, "optimizer": {}, "strategy": {},
                "train": {"iteration": self.iteration}}


def test_each_lost_rank_is_adopted_once_and_a_stand_in_is_marked(tmp_path: Path) -> None:
    """Rank 2 lost before its first checkpoint: rank 0 (first to claim its slot) stands its
    own file in, marked; rank 1 does not adopt it again; the next checkpoint carries the
    same state on; rank 2's own slot, claimed by another, is not written by it."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from shmtrain.runtime.checkpoint.checkpointer import Checkpointer
    from shmtrain.runtime.config import TrainConfig

    store = dist.HashStore()
    config = TrainConfig(checkpoint_every=10)
    ranks = [Checkpointer(SimpleNamespace(rank=r, world_size=3, store=store), config, tmp_path, 10,
                          lost=(lambda: {2}) if r < 2 else None) for r in range(3)]
    for step in (10, 20):
        ranks[0].save(_Trainer(1.0, step), step)
        ranks[1].save(_Trainer(2.0, step + 1), step)
        meta = json.loads((tmp_path / "checkpoints" / f"step-{step}" / "meta.json").read_text())
        assert [r["iteration"] for r in meta["ranks"]] == [step, step + 1, 10]
        assert meta["ranks"][2]["lost"] == {"state_of_rank": 0}
        state = torch.load(tmp_path / "checkpoints" / f"step-{step}" / "rank-2.pt", weights_only=True)
        assert float(state["model"]["w"][0]) == 1.0 and state["train"]["iteration"] == 10
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-20"
    ranks[2].save(_Trainer(3.0, 20), 20)  # the lost rank after all: its slot was filled
    state = torch.load(tmp_path / "checkpoints" / "step-20" / "rank-2.pt", weights_only=True)
    assert float(state["model"]["w"][0]) == 1.0
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))
