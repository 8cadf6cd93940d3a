"""Asynchronous strategies across two hosts: TERM's three policies hold with the
progress board on the memory server, and accuracy on digits stays within 2 points of the
same strategy on one host of four.

Two torchrun launches on this machine, each one host of two workers (``support/torchrun.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import new_segments
from support.torchrun import env, two_hosts

pytestmark = pytest.mark.timeout(300)


def _per_rank(out: Path) -> dict[int, int]:
    """Iterations each rank logged (its metrics rows), from every host's files."""
    counts = {}
    for path in (out / "metrics").glob("rank-*.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        counts[int(path.stem.split("-")[1])] = max(r["iteration"] for r in rows if "eval" not in r)
    return counts


@pytest.mark.slow  # ~35 s of CPU per policy; the policies' decisions by default in strategies/test_termination.py
@pytest.mark.parametrize("policy", [pytest.param("master", marks=pytest.mark.slow),
                                    pytest.param("first", marks=pytest.mark.slow), "average"])
def test_termination_policies_across_hosts(tmp_path: Path, policy: str) -> None:
    """ShmCaffe III-E across hosts: ``master`` ends everyone when rank 0 (host 0) reaches
    its target, ``first`` when the first worker does, ``average`` when the mean count does."""
    target = 30
    two_hosts(tmp_path, ["--strategy", "seasgd", "--iterations", str(target), "--batch-size", "16",
                          "--terminate", policy, "--no-progress"])
    done = _per_rank(tmp_path)
    assert sorted(done) == [0, 1, 2, 3]
    if policy == "master":
        assert done[0] == target
    elif policy == "first":
        assert max(done.values()) == target  # the first finisher stopped at its target, no one passed it
    else:
        assert sum(done.values()) >= 4 * target and sum(done.values()) <= 4 * target + 4
    assert not new_segments(), new_segments()


@pytest.mark.slow  # 24 runs of 20 epochs: about 4 minutes on 2 cores
@pytest.mark.parametrize("strategy", ["seasgd", "easgd", "downpour", "hsgd"])
def test_accuracy_across_hosts_is_that_of_one_host(tmp_path: Path, strategy: str) -> None:
    """Two hosts of two are not worse than one host of four by more than 2 points (median
    of three seeds each: one run of an asynchronous method on 359 held-out images swings
    by several points). Plain SGD, the papers' eq. (1): with momentum 0.9 Downpour's
    stale updates diverge in some runs on one host as well (10% accuracy)."""
    def accuracy(out: Path) -> float:
        return json.loads((out / "summary.json").read_text())["accuracy"]

    one, two = [], []
    for seed in ("1", "2", "3"):
        args = ["--strategy", strategy, "--epochs", "20", "--batch-size", "16", "--seed", seed, "--momentum", "0",
                "--lr", "0.1", "--no-progress"]
        two_hosts(tmp_path / f"two{seed}", args)
        subprocess.run([sys.executable, "-m", "shmtrain", "train", *args, "--workers", "4", "--out",
                        str(tmp_path / f"one{seed}")], check=True, timeout=240, env=env(), capture_output=True)
        one.append(accuracy(tmp_path / f"one{seed}"))
        two.append(accuracy(tmp_path / f"two{seed}"))
    assert sorted(two)[1] >= sorted(one)[1] - 0.02, (strategy, one, two)
