"""The memory server (SMB-REMOTE) lets no one in: each test makes one attack on it.

- another host reaches a server bound to loopback (network namespaces, ``two_hosts``).

Each attack is refused with one line naming it (or has no effect), and the victim's
buffers and board are what it wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

NOBODY = 65534
TMP = Path("/tmp")
needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="acting as another local user needs root and setpriv")


def _smb_entries() -> set[str]:
    """What shmtrain's memory servers may have left in /tmp (files and directories)."""
    return {p.name for p in TMP.iterdir() if p.name.startswith("shmtrain-smb")}


def _wait_gone(pids: list[int], seconds: float = 15) -> None:
    deadline = time.monotonic() + seconds
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, f"memory server {pids} did not end"
        time.sleep(0.05)


# -- 1. another host and a server bound to loopback ----------------------------------

_VICTIM = """
import json, os, subprocess, sys, threading, torch
from shmtrain.fabric.smb.remote import RemoteBufferService
from shmtrain.fabric.smb.server import MemoryServer
server = MemoryServer(1, bind="127.0.0.1", port=0, timeout=20, log=lambda line: print(line, file=sys.stderr))
serving = threading.Thread(target=server.serve, daemon=True)
serving.start()
service = RemoteBufferService(server.address, 0, 1, timeout=20)
weights = service.attach(service.create("W_global", 4))
service.write(weights, torch.tensor([1.0, 2.0, 3.0, 4.0]))
service.board.set_progress(5, 1)
listening = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True).stdout.splitlines()
mine = [line.split()[3] for line in listening if f"pid={os.getpid()}," in line]
print(json.dumps({"port": server.port, "listening": mine}), flush=True)
sys.stdin.readline()  # the attacker has tried
seen = {"values": service.read(weights, torch.zeros(4)).tolist(), "progress": service.board.progress(0),
        "alive": service.board.alive(0)}
service.close()
serving.join(10)
print(json.dumps(seen), flush=True)
"""

_ATTACKER = """
import datetime, json, sys
import torch.distributed as dist
from shmtrain.fabric.smb.wire import seal
done = {}
try:
    store = dist.TCPStore(sys.argv[1], int(sys.argv[2]), None, False, datetime.timedelta(seconds=3))
    nonce = store.get("smb/nonce").decode()  # no secret on a loopback server: any well-formed entry counts
    store.set("smb/progress/0", seal(None, nonce, "smb/progress/0", "999,2"))
    store.set("smb/dead/0", seal(None, nonce, "smb/dead/0", "1"))
    done["store"] = "written"
except Exception as exc:
    done["store"] = f"refused: {type(exc).__name__}"
print(json.dumps(done), flush=True)
"""


@pytest.fixture
def hosts():
    """Two namespaced hosts (``shmtrain.bench.hosts.two_hosts``): (a, b, address of a)."""
    from shmtrain.bench.hosts import two_hosts, why_not

    reason = why_not("none")
    if reason:
        pytest.skip(reason)
    with two_hosts("none") as made:
        yield made


@pytest.mark.timeout(60)
def test_a_server_bound_to_loopback_cannot_be_reached_from_another_host(hosts) -> None:
    """``--bind 127.0.0.1`` without a secret: the store and every gloo socket of the server
    listen on 127.0.0.1 only, so a client on host b cannot reach the store at host a's
    address (it reached it before and changed the victim's board: rank 0 "done", "dead")."""
    a, b, address_a = hosts
    victim = subprocess.Popen(["ip", "netns", "exec", a, sys.executable, "-c", _VICTIM], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        started = json.loads(victim.stdout.readline() or "{}")
        assert started, victim.stderr.read()
        attack = subprocess.run(["ip", "netns", "exec", b, sys.executable, "-c", _ATTACKER, address_a,
                                 str(started["port"])], capture_output=True, text=True, timeout=30)
        out, err = victim.communicate("tried\n", timeout=30)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.communicate()
    assert json.loads(attack.stdout)["store"].startswith("refused"), attack.stdout + attack.stderr
    assert json.loads(out) == {"values": [1.0, 2.0, 3.0, 4.0], "progress": 5, "alive": True}, out + err
    assert all(where.startswith("127.0.0.1:") for where in started["listening"]), started["listening"]
