"""A host's collective segments leave nothing in /dev/shm, even when local rank 0 is
killed (SIGKILL) while it waits for its peers to attach; peers attach through local rank
0's descriptor and share its memory."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist

from shmtrain.fabric.shm.segment import leftover

#: one local rank of a host of two: forms the HostGroup (its control block is the first
#: collective segment), then one more segment, and reports what it reads there
RANK = """
import sys, torch.distributed as dist
from shmtrain.fabric.shm.host import HostGroup
store = dist.FileStore(sys.argv[1], 2)
host = HostGroup(store, int(sys.argv[2]), 2, sys.argv[3], None, timeout=60)
segment = host.allocate("data", 4096)
view = segment.tensor(__import__("torch").int64, 0, 1)
if host.local_rank == 0:
    view.fill_(4242)
host.barrier("written")
print(int(view.item()), flush=True)
host.barrier("read")
"""


def _rank(tmp: Path, rank: int, prefix: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RANK, str(tmp / "store"), str(rank), prefix],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigkill_of_local_rank_0_waiting_for_its_peers_leaves_no_segment(tmp_path: Path) -> None:
    prefix = f"shmtrain-t{secrets.token_hex(4)}-h0"
    creator = _rank(tmp_path, 0, prefix)
    store = dist.FileStore(str(tmp_path / "store"), 2)
    deadline = time.monotonic() + 60
    try:
        while not store.check(["segment/0"]):  # the control block is made: rank 0 waits for its peer
            assert creator.poll() is None, creator.communicate()
            assert time.monotonic() < deadline, "local rank 0 never announced its segment"
            time.sleep(0.05)
        assert creator.poll() is None
        os.kill(creator.pid, signal.SIGKILL)
        creator.wait(timeout=30)
    finally:
        if creator.poll() is None:
            creator.kill()
            creator.wait()
    assert creator.returncode == -signal.SIGKILL
    assert leftover(prefix) == []


def test_peers_attach_through_local_rank_0s_descriptor_and_share_its_memory(tmp_path: Path) -> None:
    prefix = f"shmtrain-t{secrets.token_hex(4)}-h0"
    ranks = [_rank(tmp_path, r, prefix) for r in range(2)]
    outs = [p.communicate(timeout=90) for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outs
    assert [o[0].strip() for o in outs] == ["4242", "4242"]
    assert leftover(prefix) == []
