"""ShmtrainStrategy's checkpoints: a Lightning run interrupted and resumed from its
checkpoint equals the uninterrupted one (ssgd), and an asynchronous method resumes its
global weights W_g and every rank's own state exactly (seasgd)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning", reason="Lightning is not installed (pip install -e '.[test]')")

from support.lightning_runs import lightning_command, rel, run, seen, weights  # noqa: E402


def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path: Path) -> None:
    ckpts = tmp_path / "ckpt"
    whole, resumed = tmp_path / "whole.pt", tmp_path / "resumed.pt"
    run({"whole": lightning_command(whole, epochs=3, ckpt_dir=str(ckpts))})
    first = ckpts / "epoch=0.ckpt"
    saved = torch.load(first, weights_only=True)
    assert saved["shmtrain"]["strategy"]["iteration"] == 8 and not saved["shmtrain"]["ranks_apart"]
    assert not list(ckpts.glob("*.rank*"))  # synchronous: rank 0's file is the job's
    run({"resumed": lightning_command(resumed, epochs=3, resume=str(first))})
    start = torch.load(f"{resumed}.start", weights_only=True)
    assert start["strategy"]["iteration"] == 8  # the method's iteration came back
    params = torch.cat([v.reshape(-1) for v in saved["state_dict"].values()])
    assert torch.equal(start["params"], params)  # and the weights
    assert seen(resumed)["iteration"] == seen(whole)["iteration"] == 24
    assert rel(weights(whole), weights(resumed)) < 1e-6
    assert rel(weights(whole), params) > 1e-3  # the last two epochs moved the weights


def test_an_asynchronous_method_resumes_its_global_weights_and_every_ranks_state(tmp_path: Path) -> None:
    ckpts = tmp_path / "ckpt"
    whole, resumed = tmp_path / "whole.pt", tmp_path / "resumed.pt"
    settings = {"method": "seasgd", "options": {"update_interval": 2}, "epochs": 2}
    run({"whole": lightning_command(whole, ckpt_dir=str(ckpts), **settings)})
    first = ckpts / "epoch=0.ckpt"
    saved = torch.load(first, weights_only=True)["shmtrain"]
    assert saved["ranks_apart"] and saved["strategy"]["iteration"] == 8
    w_g = saved["strategy"]["global_weights"]
    shard = torch.load(Path(f"{first}.rank1"), weights_only=True)  # rank 1's own replica and state
    assert shard["strategy"]["iteration"] == 8 and "global_weights" not in shard["strategy"]
    run({"resumed": lightning_command(resumed, resume=str(first), **settings)})
    start = torch.load(f"{resumed}.start", weights_only=True)
    assert torch.equal(start["strategy"]["global_weights"], w_g)  # W_g exactly as saved
    assert start["strategy"]["iteration"] == 8
    assert seen(resumed)["iteration"] == 16
    assert rel(w_g, torch.cat([v.reshape(-1) for v in shard["model"].values()])) > 0  # the replicas differ from W_g
