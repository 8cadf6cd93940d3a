"""ShmtrainStrategy across hosts (torchrun launches on this machine, one per host, each a
host of its own): Lightning's ``num_nodes`` with shmtrain's hierarchical ssgd equals the
plain DataParallel loop of the same world on one host, and an asynchronous method meets at
its memory server."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="Lightning is not installed (pip install -e '.[test]')")

from support.lightning_runs import lightning_torchrun_command, plain_command, rel, run, seen, weights  # noqa: E402
from support.torchrun import free_port  # noqa: E402


@pytest.mark.slow  # ~2 min on 2 cores: 8 processes
def test_two_hosts_of_two_equal_the_plain_loop_of_four(tmp_path: Path) -> None:
    ours, plain = tmp_path / "hosts.pt", tmp_path / "plain.pt"
    port = free_port()
    run({**{f"host{n}": lightning_torchrun_command(ours, workers=2, nodes=2, node=n, port=port) for n in (0, 1)},
         "plain": plain_command(plain, workers=4)})
    assert rel(weights(plain), weights(ours)) < 1e-6
    assert seen(ours)["iteration"] == seen(plain)["iteration"] == 8  # 2 epochs of 128 / (4 x 8)


@pytest.mark.slow  # ~1.5 min on 2 cores
def test_seasgd_across_two_hosts_trains_through_its_memory_server(tmp_path: Path) -> None:
    ours = tmp_path / "hosts.pt"
    port = free_port()
    settings = {"method": "seasgd", "options": {"update_interval": 2}, "epochs": 4, "samples": 256}
    run({f"host{n}": lightning_torchrun_command(ours, workers=1, nodes=2, node=n, port=port, **settings)
         for n in (0, 1)})
    result = seen(ours)
    assert result["iteration"] == 64
    start = result["initial_accuracy"]
    assert result["centre_accuracy"] > start + 0.1 and result["accuracy"] > start + 0.1, result


@pytest.mark.slow  # ~2 min on 2 cores: 4 processes on 2 hosts
def test_the_hybrid_across_hosts_trains_inside_lightning(tmp_path: Path) -> None:
    """diloco --inner host-sync: synchronous SGD inside each host, DiLoCo between the hosts."""
    ours = tmp_path / "hosts.pt"
    port = free_port()
    settings = {"method": "diloco", "options": {"inner": "host-sync", "sync_every": 4}, "epochs": 4, "samples": 256}
    run({f"host{n}": lightning_torchrun_command(ours, workers=2, nodes=2, node=n, port=port, **settings)
         for n in (0, 1)})
    result = seen(ours)
    assert result["iteration"] == 32  # 4 epochs of 256 / (4 x 8)
    assert result["accuracy"] > result["initial_accuracy"] + 0.1, result
