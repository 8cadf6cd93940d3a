"""Two hosts in network namespaces joined by a veth pair.

Each test makes its own namespaces (``st<pid>a``/``st<pid>b``, 10.77.x.1 and .2) and
removes them, shaped with ``tc qdisc ... tbf rate 1gbit`` where asked. They need root
and ``ip netns``, and skip with the reason elsewhere. Traffic stays inside the pair.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shmtrain.bench.hosts.command import host_env, two_hosts, why_not

pytestmark = pytest.mark.timeout(240)

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


@pytest.fixture
def hosts(request) -> Iterator[tuple[str, str, str]]:
    """Two namespaces and a veth pair between them: (namespace a, namespace b, address of a)."""
    reason = why_not("none")
    if reason:
        pytest.skip(reason)
    rate = "1gbit" if getattr(request, "param", None) == "1gbit" and shutil.which("tc") else "none"
    with two_hosts(rate) as (a, b, master):
        yield a, b, master
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert a not in listed and b not in listed, "a test namespace was left behind"


def _two_hosts(hosts: tuple[str, str, str], out: Path, args: list[str]) -> list[str]:
    a, b, master = hosts
    procs = []
    for node, ns in enumerate((a, b)):
        cmd = ["ip", "netns", "exec", ns, *TORCHRUN, "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--master-addr", master, "--master-port", "29500",
               "--rdzv-conf", "timeout=60", "-m", "shmtrain", "train", *args, "--timeout", "60",
               "--no-progress", "--out", str(out)]
        procs.append(subprocess.Popen(cmd, env=host_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=200)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), outputs
    return outputs


def test_ssgd_across_two_namespaced_hosts_picks_the_routed_interface(hosts, tmp_path: Path) -> None:
    outputs = _two_hosts(hosts, tmp_path, ["--strategy", "ssgd", "--iterations", "8", "--batch-size", "16"])
    assert "gloo uses interface st" in outputs[1] and "routes to MASTER_ADDR" in outputs[1]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["workers"] == 4 and summary["iterations"] == 8


@pytest.mark.slow  # ~33 s of CPU; ssgd across namespaced hosts runs by default
@pytest.mark.parametrize("hosts", ["1gbit"], indirect=True)
def test_seasgd_across_two_hosts_on_a_shaped_link_starts_its_memory_server(hosts, tmp_path: Path) -> None:
    # no --smb-server: rank 0 starts one on 10.77.x.1 with a generated secret
    import glob
    import tempfile

    logs = set(glob.glob(os.path.join(tempfile.gettempdir(), "shmtrain-smb-*.log")))
    _two_hosts(hosts, tmp_path, ["--strategy", "seasgd", "--iterations", "12", "--batch-size", "16"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    # the average policy (TERM): the job's work is 4 x 12 iterations, however it is shared
    # out (a loaded host's rank 0, beside the memory server, may do fewer than the others)
    done = summary["iterations_per_rank"]
    assert summary["workers"] == 4 and len(done) == 4 and sum(done.values()) >= 4 * 12, done
    deadline = time.monotonic() + 15  # the server ends with the job, its log with it
    while set(glob.glob(os.path.join(tempfile.gettempdir(), "shmtrain-smb-*.log"))) - logs:
        assert time.monotonic() < deadline, "the memory server's log outlived a clean run"
        time.sleep(0.2)


@pytest.mark.slow  # torchrun's own rendezvous timeout, not shmtrain's code
def test_a_host_whose_peer_never_comes_fails_within_the_timeout(hosts, tmp_path: Path) -> None:
    a, b, master = hosts
    proc = subprocess.run(["ip", "netns", "exec", b, *TORCHRUN, "--nnodes", "2", "--node-rank", "1",
                           "--nproc-per-node", "1", "--master-addr", master, "--master-port", "29500",
                           "--rdzv-conf", "timeout=5", "-m", "shmtrain", "train", "--timeout", "5",
                           "--out", str(tmp_path)], env=host_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"({master}, 29500)" in proc.stderr + proc.stdout  # torchrun names the address it waited for


def test_shmtrains_own_rendezvous_names_the_address_and_the_fix(monkeypatch) -> None:
    # no namespace needed: rank 1 of a job whose rank 0 never listens, on loopback (in this process)
    import socket

    from shmtrain.fabric.job.context import from_env

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as failed:
        from_env(timeout=3)
    assert f"cannot join the job's rendezvous at 127.0.0.1:{port}" in str(failed.value), str(failed.value)
    assert "is node 0 started" in str(failed.value)


# gpi and cpu_acc across hosts are in the default suite through tests/runtime/hosts/test_torchrun.py
# (same weights as one host of four), and the interface choice through the ssgd test above
@pytest.mark.parametrize("strategy", [pytest.param("gpi", marks=pytest.mark.slow),
                                      pytest.param("cpu_acc", marks=pytest.mark.slow),
                                      pytest.param("hsgd", marks=pytest.mark.slow),
                                      pytest.param("easgd", marks=pytest.mark.slow),
                                      pytest.param("downpour", marks=pytest.mark.slow),
                                      pytest.param("ps_grad", marks=pytest.mark.slow),
                                      pytest.param("ps_weight", marks=pytest.mark.slow)])
def test_every_strategy_across_two_namespaced_hosts(hosts, tmp_path: Path, strategy: str) -> None:
    # gpi and cpu_acc: the hosts' leaders sum each layer over the veth link (HostCombiner)
    _two_hosts(hosts, tmp_path, ["--strategy", strategy, "--iterations", "8", "--batch-size", "16"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["workers"] == 4 and summary["iterations"] >= 8
