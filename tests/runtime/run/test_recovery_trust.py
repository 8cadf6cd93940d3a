"""The plan and the donor's state of a replacement in place come from this run alone: a
plan naming another process, or a state file someone else could write, is refused
(docs/security.md, "A worker replaced in place")."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from shmtrain.fabric.shm.control import PeerFailure
from shmtrain.fabric.trust import UntrustedError, private_dir
from shmtrain.runtime.launch.replacement import LAUNCHER_ENV
from shmtrain.runtime.run import recovery

pytestmark = pytest.mark.timeout(30)


def _ctx(plan: dict) -> SimpleNamespace:
    store = dist.HashStore()
    store.set("recover/plan", json.dumps(plan))
    return SimpleNamespace(store=store, timeout=1.0, local_rank=1)


def test_a_plan_naming_another_process_than_the_launcher_is_refused(monkeypatch) -> None:
    monkeypatch.setenv(LAUNCHER_ENV, str(os.getpid()))
    plan = {"generation": 1, "donor": 0, "steps": 5, "pid": os.getppid(), "fd": 3, "control": "x", "state": "y"}
    with pytest.raises(UntrustedError, match="not this run's launcher"):
        recovery.read_plan(_ctx(plan), PeerFailure("peer 0 died"))
    plan["pid"] = os.getpid()
    assert recovery.read_plan(_ctx(plan), PeerFailure("peer 0 died"))["donor"] == 0  # the launcher's own: taken


def test_the_launchers_no_raises_the_peers_failure(monkeypatch) -> None:
    monkeypatch.setenv(LAUNCHER_ENV, str(os.getpid()))
    failure = PeerFailure("local rank 0 died", peer=0)
    with pytest.raises(PeerFailure, match="local rank 0 died"):
        recovery.read_plan(_ctx({"fail": True}), failure)


def test_a_donor_state_that_others_can_write_is_refused(tmp_path: Path) -> None:
    folder = private_dir("shmtrain-test-recover-")
    try:
        good = folder / "recover-g1.pt"
        buffer = io.BytesIO()
        torch.save({"train": {"iteration": 3}}, buffer)
        good.write_bytes(buffer.getvalue())
        good.chmod(0o600)
        assert recovery.load_state(good, 1.0)["train"]["iteration"] == 3
        good.chmod(0o666)
        with pytest.raises(UntrustedError):
            recovery.load_state(good, 1.0)
        os.chmod(folder, 0o777)  # a folder others can enter and write
        good.chmod(0o600)
        with pytest.raises(UntrustedError):
            recovery.load_state(good, 1.0)
    finally:
        os.chmod(folder, 0o700)
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()


def test_a_donor_state_holding_code_is_refused(tmp_path: Path) -> None:
    folder = private_dir("shmtrain-test-recover-")
    try:
        bad = folder / "recover-g1.pt"
        buffer = io.BytesIO()
        torch.save({"train": SimpleNamespace(iteration=3)}, buffer)  # an object: weights_only refuses it
        bad.write_bytes(buffer.getvalue())
        bad.chmod(0o600)
        with pytest.raises(Exception, match="[Ww]eights only"):
            recovery.load_state(bad, 1.0)
    finally:
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()


def test_the_rows_a_recovered_rank_lacks_are_logged_once_each(tmp_path: Path) -> None:
    metrics = tmp_path / "rank-1.jsonl"
    metrics.write_text("".join(json.dumps({"iteration": i, "loss": 1.0}) + "\n" for i in range(1, 5)))
    adopted = {"train": {"iteration": 5}, recovery.PENDING: {"iteration": 5, "loss": 0.5, "lr": 0.1}}
    rows = recovery.catch_up_rows(adopted, metrics, 0.0)
    assert [(r["iteration"], r["loss"], r.get("recovered")) for r in rows] == [(5, 0.5, True)]
    replacement = {"train": {"iteration": 6}, recovery.PENDING: None}  # the dead worker had logged 4
    rows = recovery.catch_up_rows(replacement, metrics, 0.0)
    assert [(r["iteration"], r["loss"], "lost" in r) for r in rows] == [(5, None, True), (6, None, True)]
    assert recovery.catch_up_rows({"train": {"iteration": 4}}, metrics, 0.0) == []


def test_the_donor_is_the_dead_ranks_replica_a_step_ahead_else_the_first_survivor() -> None:
    # ssgd: one block of every rank; the most steps wins, the lowest rank among equals
    assert recovery.choose_donor({0: 7, 2: 8}, 1, 3) == (2, True)
    assert recovery.choose_donor({1: 8, 2: 8}, 0, 3) == (1, True)
    # hsgd, groups of 2: rank 3's group is {2, 3}; rank 0's is {0, 1}
    assert recovery.choose_donor({0: 9, 1: 9, 2: 4}, 3, 2) == (2, True)
    assert recovery.choose_donor({1: 5, 2: 4, 3: 4}, 0, 2) == (1, True)
    # seasgd: every worker alone: the first survivor gives W_g
    assert recovery.choose_donor({1: 50, 2: 70}, 0, 1) == (1, False)
