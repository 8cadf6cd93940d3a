"""Jobs started by torchrun: the own-loop example, and two hosts on one machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import new_segments
from shmtrain.cli import main
from shmtrain.runtime.data.tensors import load_digits_data
from support.paths import ROOT
from support.torchrun import TORCHRUN, env, free_port, same_weights, two_hosts


def test_own_loop_example_under_torchrun_matches_single_process(tmp_path: Path) -> None:
    out = tmp_path / "w.pt"
    cmd = TORCHRUN + ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                      str(ROOT / "examples" / "own_loop.py"), "--steps", "20", "--out", str(out)]
    subprocess.run(cmd, check=True, timeout=150, env=env(), capture_output=True)
    got = torch.load(out)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    data = load_digits_data()
    for step in range(20):
        start = (step * 32) % (len(data.train_x) - 32)
        opt.zero_grad()
        nn.CrossEntropyLoss()(model(data.train_x[start : start + 32]), data.train_y[start : start + 32]).backward()
        opt.step()
    for name, value in model.state_dict().items():
        assert float((got[name] - value).norm() / value.norm()) < 1e-5, name
    assert not new_segments(), new_segments()


COMMON = ["--strategy", "ssgd", "--iterations", "15", "--batch-size", "8", "--seed", "3", "--no-progress"]


@pytest.mark.parametrize("overlap", [True, pytest.param(False, marks=pytest.mark.slow)])  # ~12 s each run
def test_two_hosts_equal_one_host_of_four(tmp_path: Path, overlap: bool) -> None:
    """ssgd --overlap (buckets reduced in each host's shared memory, then between the
    hosts' leaders over gloo), and plain ssgd (slow: it runs across namespaced hosts by
    default in runtime/hosts/test_netns.py), across two hosts, against one host of four. With --overlap,
    host 1 starts through ``shmtrain torchrun`` and host 0 through torchrun: hosts need
    not share a launcher (and one fresh interpreter per worker fewer to wait for)."""
    common = COMMON
    runs = {"two_overlap": [*common, "--overlap", "--bucket-mb", "0.02"]} if overlap else {"two": common}
    for name, args in runs.items():
        two_hosts(tmp_path / name, args, forked=(1,) if overlap else ())
    if overlap:
        assert "overlap = true" in (tmp_path / "two_overlap" / "config.toml").read_text()
    assert main(["train", *common, "--workers", "4", "--out", str(tmp_path / "one")]) == 0  # in this process
    one = torch.load(tmp_path / "one" / "model.pt")
    for name in runs:
        two = torch.load(tmp_path / name / "model.pt")
        for key in one:
            assert float((two[key] - one[key]).norm() / one[key].norm()) < 1e-5, (name, key)
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["workers"] == 4 and summary["iterations"] == 15
    assert not new_segments(), new_segments()


@pytest.mark.slow  # ~48 s: two torchrun hosts twice; two hosts equal one host of four by default above
def test_gpi_and_cpu_acc_across_hosts_equal_one_host(tmp_path: Path) -> None:
    """gpi's tree and cpu_acc's accumulation inside each host, the layers summed between the
    hosts' leaders (HostCombiner): two hosts of two against one host of four."""
    common = ["--iterations", "12", "--batch-size", "8", "--seed", "5", "--no-progress"]
    for strategy in ("gpi", "cpu_acc"):
        args = ["--strategy", strategy, *common]
        two_hosts(tmp_path / f"{strategy}-2x2", args)
        subprocess.run([sys.executable, "-m", "shmtrain", "train", *args, "--workers", "4",
                        "--out", str(tmp_path / f"{strategy}-1x4")], check=True, timeout=150, env=env(),
                       capture_output=True)
        same_weights(tmp_path / f"{strategy}-1x4", tmp_path / f"{strategy}-2x2")
        summary = json.loads((tmp_path / f"{strategy}-2x2" / "summary.json").read_text())
        assert summary["workers"] == 4 and summary["iterations"] == 12
    assert not new_segments(), new_segments()


# staged equals unstaged on one host by default in strategies/layout/test_staged.py
@pytest.mark.slow  # ~50 s: every staged strategy across hosts
def test_staged_strategies_across_hosts_equal_one_host_unstaged(tmp_path: Path, monkeypatch) -> None:
    """The GPU data flow (SHMTRAIN_STAGING=copy: private parameters, copies to and from the
    host buffers) across two hosts: ssgd's staged slots under the hierarchical allreduce,
    and gpi's host copies of the gradients that the leaders' HostCombiner sums, against
    one unstaged host of four."""
    common = ["--iterations", "10", "--batch-size", "8", "--seed", "7", "--no-progress"]
    for strategy in ("ssgd", "gpi"):
        args = ["--strategy", strategy, *common]
        subprocess.run([sys.executable, "-m", "shmtrain", "train", *args, "--workers", "4",
                        "--out", str(tmp_path / f"{strategy}-1x4")], check=True, timeout=150, env=env(),
                       capture_output=True)
        monkeypatch.setenv("SHMTRAIN_STAGING", "copy")
        two_hosts(tmp_path / f"{strategy}-2x2", args)
        monkeypatch.delenv("SHMTRAIN_STAGING")
        same_weights(tmp_path / f"{strategy}-1x4", tmp_path / f"{strategy}-2x2")
        phases = {name: json.loads((tmp_path / name / "summary.json").read_text())["phases_ms"]
                  for name in (f"{strategy}-1x4", f"{strategy}-2x2")}
        assert "copy_to_host" in phases[f"{strategy}-2x2"] and "copy_to_host" not in phases[f"{strategy}-1x4"]
    assert not new_segments(), new_segments()


@pytest.mark.slow  # two more launches of the same code path
def test_cpu_acc_on_three_hosts_equals_one_host_of_three(tmp_path: Path) -> None:
    common = ["--iterations", "12", "--batch-size", "8", "--seed", "5", "--no-progress"]
    args = ["--strategy", "cpu_acc", *common]
    two_hosts(tmp_path / "cpu_acc-3x1", args, nodes=3, per_node=1)
    subprocess.run([sys.executable, "-m", "shmtrain", "train", *args, "--workers", "3",
                    "--out", str(tmp_path / "cpu_acc-1x3")], check=True, timeout=150, env=env(), capture_output=True)
    same_weights(tmp_path / "cpu_acc-1x3", tmp_path / "cpu_acc-3x1")
    assert not new_segments(), new_segments()
