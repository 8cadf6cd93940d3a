"""A lost host is named by host and rank on the hosts that survive it, and the survivor
is not blamed: two ``shmtrain torchrun`` hosts of one worker train ssgd; host 1's worker is
killed (SIGKILL); host 0's worker, whose gloo connection to it is reset, posts its failure
in the job's store, finds in a roll call the rank that never posted, and ends with one
line naming it (``runtime/run/training.py``, ``runtime/launch/failures.py``)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from support.torchrun import env, free_port


def _rows(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except FileNotFoundError:
        return 0


def test_the_roll_call_names_the_ranks_that_never_reported_by_host(monkeypatch) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from shmtrain.runtime.launch import failures
    from shmtrain.runtime.run import torchrun as torchrun_job

    monkeypatch.setattr(failures, "ROLL_CALL_S", 0.5)  # how long rank 2 is waited for

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    store.set("failed/1", "local rank 0 failed")  # host 0's other worker failed for a cause of its own
    ctx = SimpleNamespace(store=store, rank=0, world_size=4, local_world=2, node_rank=0)
    gloo = RuntimeError("[/gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:35229. This is "
                        "typically caused by a remote worker crashing. GLHF!")
    store.set("failed/3", "stopped by SIGTERM")  # host 1's survivor, ended by its agent
    lost = torchrun_job.lost_peers(ctx, gloo)
    assert str(lost) == ("worker rank 2 (host 1, local rank 0) was lost: it stopped without reporting an error "
                         "(killed, or the host went down; see that host's output); worker rank 0 (host 0) only "
                         "lost its connection to it (Connection closed by peer [127.0.0.1]:35229)")
    assert store.get("failed/0") == b"Connection closed by peer [127.0.0.1]:35229"
    assert torchrun_job.lost_peers(ctx, ValueError("a cause of its own")) is None  # posted, and stands as it is


@pytest.mark.slow  # two torchrun hosts start: over 30 s on a busy machine
@pytest.mark.timeout(240)
def test_a_lost_host_is_named_by_host_and_rank_and_the_survivor_is_not_blamed(tmp_path: Path) -> None:
    out, port = tmp_path / "run", free_port()

    def host(node: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "shmtrain", "torchrun", "--nnodes", "2", "--node-rank", str(node),
             "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), "train",
             "--strategy", "ssgd", "--iterations", "100000", "--batch-size", "8", "--timeout", "30",
             "--no-progress", "--checkpoint-every", "0", "--out", str(out)],
            env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    nodes = [host(0), host(1)]
    try:
        deadline = time.monotonic() + 150
        while _rows(out / "metrics" / "rank-1.jsonl") < 3:  # host 1's worker trains
            assert time.monotonic() < deadline and all(n.poll() is None for n in nodes), "host 1 never trained"
            time.sleep(0.2)
        for worker in psutil.Process(nodes[1].pid).children():
            worker.kill()
        outputs = [n.communicate(timeout=120)[0].decode(errors="replace") for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
                n.wait()
    survivor = outputs[0]
    assert nodes[0].returncode != 0
    assert "worker rank 1 (host 1, local rank 0) was lost" in survivor, survivor[-3000:]
    assert "only lost its connection" in survivor, survivor[-3000:]
    line = next(x for x in survivor.splitlines() if x.startswith("shmtrain: error:"))
    assert "only lost its connection to it (" in line and "Connection" in line and "GLHF" not in line, line
    assert "trainer.py" not in survivor and "shm_allreduce.py" not in survivor, survivor[-3000:]  # no worker traceback
    assert "failed on this host: rank 0" not in survivor, survivor[-3000:]
