"""A lost host comes back: elastic asynchronous jobs.

Two torchrun launches on this machine, each one host of two workers, train seasgd
through the memory server global rank 0 starts. While they train, the test kills
(SIGKILL) every process of host 1, its torchrun agent included, waits 5 s, and starts
host 1 again with the same command. Its workers rejoin the running job: they pull the
global weights and their iteration counts (TERM) from the memory server, and both hosts
train to the end while host 0 never stops. Host 1's first iteration after the rejoin
starts from the global weights: its loss is no higher than the job's before the loss
(within noise; a fresh start's is ~2.3). No segment or process may be left behind.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import new_segments
from shmtrain import strategies
from shmtrain.fabric.job import context
from shmtrain.fabric.shm.control import PeerFailure
from support.memory_server import running_servers
from support.torchrun import agent_workers, env, free_port, host_command, training_rows

pytestmark = pytest.mark.timeout(240)


def test_each_start_of_a_host_is_counted_and_its_workers_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Local rank 0 counts its node slot's starts; its host's other workers read the count
    under their agent's pid; a second agent of the same slot is a rejoin (start 2)."""
    store = dist.HashStore()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setattr(context.os, "getppid", lambda: 1000)
    assert [context._host_start(store, 1, r, 2) for r in (0, 1)] == [1, 1]
    assert context._host_start(store, 0, 0, 2) == 1  # another slot counts apart
    monkeypatch.setattr(context.os, "getppid", lambda: 2000)  # host 1's agent, started again
    assert [context._host_start(store, 1, r, 2) for r in (0, 1)] == [2, 2]
    assert context._host_start(store, 1, 0, 1) == 1  # one host: nothing to rejoin
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert context._host_start(store, 1, 0, 2) == 1  # not torchrun: one start


def test_a_host_started_after_the_job_ended_is_refused() -> None:
    store = dist.HashStore()
    context._check_running(store, 1, "10.0.0.1")  # still training: nothing said
    store.set("results/done", "1")
    with pytest.raises(PeerFailure, match="host 1 started again after the job at 10.0.0.1 had ended"):
        context._check_running(store, 1, "10.0.0.1")


@pytest.mark.parametrize("name", ["diloco", "ssgd", "gpi"])
def test_a_strategy_whose_hosts_meet_in_gloo_refuses_a_rejoin(name: str) -> None:
    cls = strategies.get(name)
    ctx = SimpleNamespace(num_nodes=2, node_rank=1, rejoined=True)
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=f"host 1 started again .* --strategy {name} cannot take a lost host "
                                         "back .* shmtrain train --resume"):
        cls(cls.Config(), ctx, model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert not cls.rejoins and all(strategies.get(s).rejoins for s in ("seasgd", "easgd", "downpour", "hsgd"))

#: a paced model (20 ms per forward): the run outlasts host 1's absence on a loaded machine
ARGS = ["--model", "support.paced_model:PacedMLP", "--model-args", "delay=0.02", "--iterations", "1500",
        "--batch-size", "16", "--timeout", "30", "--no-progress", "--lr", "0.1"]


def _losses(path: Path) -> dict[int, float]:
    """iteration -> loss of one rank's metrics file (rows cut short by a kill skipped)."""
    found = {}
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            row = json.loads(line)
            if "eval" not in row:
                found[int(row["iteration"])] = float(row["loss"])
    return found


def _kill_host(agent: psutil.Process) -> None:
    """SIGKILL a host's agent and everything under it, at once."""
    victims = [agent, *agent.children(recursive=True)]
    for victim in victims:
        with contextlib.suppress(psutil.Error):
            victim.kill()
    psutil.wait_procs(victims, timeout=30)


def _start(node: int, port: int, out: Path, args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(host_command(node, 2, 2, port, [*args, "--out", str(out)]), env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


# a client's rejoin runs by default in fabric/smb/test_lost_client_reconnects.py
@pytest.mark.slow  # ~75 s: two hosts, one lost and started again
@pytest.mark.parametrize("strategy", ["seasgd", pytest.param("hsgd", marks=pytest.mark.slow),
                                      pytest.param("easgd", marks=pytest.mark.slow),
                                      pytest.param("downpour", marks=pytest.mark.slow)])
def test_a_lost_host_started_again_rejoins_and_both_train_to_the_end(tmp_path: Path, strategy: str) -> None:
    before = set(running_servers())
    out, port = tmp_path / "run", free_port()
    args = ["--strategy", strategy, *ARGS]
    nodes = [_start(0, port, out, args), _start(1, port, out, args)]
    try:
        deadline = time.monotonic() + 150
        while training_rows(out / "metrics" / "rank-2.jsonl") < 40:  # host 1 is training
            assert time.monotonic() < deadline and nodes[1].poll() is None, "host 1 never trained"
            time.sleep(0.1)
        agent = psutil.Process(nodes[1].pid)
        assert set(agent_workers(agent)) == {0, 1}
        job = _losses(out / "metrics" / "rank-0.jsonl")
        _kill_host(agent)
        nodes[1].communicate(timeout=10)
        time.sleep(5)
        assert nodes[0].poll() is None, "host 0 stopped when host 1 was lost"
        assert training_rows(out / "metrics" / "rank-0.jsonl") > max(job) + 50, "host 0 did not train on alone"
        nodes.append(_start(1, port, out, args))  # the same command
        outputs = [nodes[0].communicate(timeout=200)[0].decode(), nodes[2].communicate(timeout=60)[0].decode()]
    finally:
        for p in nodes:
            if p.poll() is None:  # a failed test: the host's workers too (they outlive their agent)
                with contextlib.suppress(psutil.Error):
                    _kill_host(psutil.Process(p.pid))
                p.communicate()
    assert nodes[0].returncode == 0 and nodes[2].returncode == 0, outputs
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workers"] == 4 and summary["workers_finished"] == 4, summary
    assert not summary.get("lost_workers"), summary  # both of host 1's ranks came back
    rejoined = {int(r): int(n) for r, n in re.findall(r"worker rank (\d) rejoined the running job at iteration (\d+)",
                                                       outputs[1])}
    assert sorted(rejoined) == [2, 3] and min(rejoined.values()) >= 40, outputs[1][-3000:]
    recent = [job[i] for i in sorted(job)[-20:]]
    before_loss = sum(recent) / len(recent)  # the job's loss before host 1 was lost
    for rank, at in rejoined.items():
        losses = _losses(out / "metrics" / f"rank-{rank}.jsonl")
        assert max(losses) > at + 20, (rank, at, max(losses))  # it trained on after the rejoin
        first = losses[at + 1]  # the first iteration after the rejoin: from the global weights
        assert first <= before_loss + 0.3 and first < 1.5, (rank, first, before_loss)
    assert summary["iterations"] >= 1500
    deadline = time.monotonic() + 15  # the memory server ends once every client left
    while set(running_servers()) - before:
        assert time.monotonic() < deadline, "the memory server outlived the job"
        time.sleep(0.2)
    assert not new_segments(), new_segments()
