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
from shmtrain.strategies.optim import step_journal

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


def _journal(folder: Path) -> tuple[step_journal.StepJournal, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    names = [name for name, _ in model.named_parameters()]
    return step_journal.StepJournal(folder, names, list(model.parameters()), optimizer), model, optimizer


def test_the_step_journal_gives_back_the_state_of_its_step_alone() -> None:
    """gpi's journal: the weights and the optimizer state after step t, from slot t % 2;
    another step, or a slot whose write a death cut short, gives nothing."""
    folder = private_dir("shmtrain-test-journal-")
    try:
        journal, model, optimizer = _journal(folder)
        assert journal.write(7)
        weights, state = step_journal.read(folder, 7)
        for name, value in model.state_dict().items():
            assert weights[name].equal(value), name
        expected = optimizer.state_dict()["state"]
        assert state.keys() == expected.keys()
        for index, entries in expected.items():
            for key, value in entries.items():
                assert torch.equal(state[index][key], value), (index, key)
        assert step_journal.read(folder, 6) is None and step_journal.read(folder, 9) is None  # other steps
        with torch.no_grad():
            model[0].weight.add_(1.0)
        assert journal.write(8)  # the other slot: step 7 is still there, unchanged
        assert not step_journal.read(folder, 7)[0]["0.weight"].equal(model[0].weight)
        assert step_journal.read(folder, 8)[0]["0.weight"].equal(model[0].weight)
        os.pwrite(journal.fds[0], step_journal._HEAD.pack(-1, 0), 0)  # step 8's write cut short by a death
        assert step_journal.read(folder, 8) is None and step_journal.read(folder, 7) is not None
        journal.close()
    finally:
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()


def test_a_step_journal_others_could_write_or_naming_no_dtype_is_refused() -> None:
    folder = private_dir("shmtrain-test-journal-")
    try:
        journal, _, _ = _journal(folder)
        journal.write(3)
        journal.close()
        path = step_journal.slot_path(folder, 1)
        path.chmod(0o666)  # a slot another user could have written
        with pytest.raises(UntrustedError):
            step_journal.read(folder, 3)
        path.chmod(0o600)
        data = bytearray(path.read_bytes())  # a header naming something that is not a dtype
        at = data.index(b'"float32"')
        data[at:at + 9] = b'"os.path"'
        path.write_bytes(bytes(data))
        with pytest.raises(ValueError, match="not a dtype"):
            step_journal.read(folder, 3)
        path.unlink()
        path.symlink_to(folder / "elsewhere")  # a link planted in the slot's place: not followed
        with pytest.raises(OSError):
            step_journal.StepJournal(folder, [], [], torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    finally:
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
