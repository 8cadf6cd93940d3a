"""The memory server (SMB-REMOTE) lets no one in: each test makes one attack on it.

- another host reaches a server bound to loopback (network namespaces, ``two_hosts``);
- a proof of the shared secret captured on the network is replayed;
- a worker is pointed at a fake server (one without the job's secret);
- another local user (``nobody``) plants the job's own server's address file in /tmp;
- someone who can read torchrun's store looks for the job's own server's secret there.

Each attack is refused with one line naming it (or has no effect), and the victim's
buffers and board are what it wrote. The proof "captured from the network" is the bytes
the victim sent on its link for it (gloo sends in clear: what a sniffer on the path
sees), taken by a tap on the victim's link and sent by the attacker's in place of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist

from shmtrain.fabric.smb import remote
from shmtrain.fabric.smb.remote import RemoteBufferService
from shmtrain.fabric.smb.server import MemoryServer
from shmtrain.fabric.smb.wire import TAG_TO_SERVER
from shmtrain.fabric.transports import Transports
from shmtrain.runtime.launch.launcher import launch

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="acting as another local user needs root and setpriv")


def _server(clients: int, secret_file: Path) -> tuple[subprocess.Popen, str]:
    """A stand-alone ``shmtrain smb-server`` on loopback, any free port: (process, address)."""
    proc = subprocess.Popen([sys.executable, "-m", "shmtrain", "smb-server", "--clients", str(clients), "--port", "0",
                             "--timeout", "30", "--secret-file", str(secret_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    assert "serving" in first, first + proc.stderr.read()
    return proc, first.split(" at ")[1].split(" ")[0]


def _finish(proc: subprocess.Popen) -> tuple[str, str]:
    """The server's output once it ended (killed after 30 s: its clients never said goodbye)."""
    try:
        return proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


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
    """Two namespaced hosts (``shmtrain.bench.hosts.command.two_hosts``): (a, b, address of a)."""
    from shmtrain.bench.hosts.command import two_hosts, why_not

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


# -- 2. a captured proof, replayed ------------------------------------------------------

class _Tap:
    """A client's link, with what it sends for its proof of the secret (``TAG_TO_SERVER``)
    seen by ``on_proof``, which returns what is sent instead."""

    def __init__(self, link: dist.ProcessGroup, on_proof) -> None:
        self._link, self._on_proof = link, on_proof

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int):
        if tag == TAG_TO_SERVER:
            tensors = self._on_proof(tensors)
        return self._link.send(tensors, dst, tag)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._link, name)


def _tapped(monkeypatch: pytest.MonkeyPatch, on_proof) -> None:
    """The next client's link goes through a :class:`_Tap`."""
    join = remote.join

    def tapped(*args, **kwargs):
        formed = join(*args, **kwargs)
        if isinstance(formed, tuple):
            return (*formed[:-1], _Tap(formed[-1], on_proof))
        return _Tap(formed, on_proof)

    monkeypatch.setattr(remote, "join", tapped)


@pytest.mark.timeout(60)
def test_a_captured_proof_replayed_by_a_client_without_the_secret_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The victim proves the secret; its proof is captured; a client without the secret
    sends that proof on a new connection. Before, the proof was the same for every
    connection and the attacker read W_global and wrote -666 into it, which the victim
    then read; now it is refused as a replay, named, and W_global is the victim's."""
    secret_file = tmp_path / "secret"
    secret_file.write_text("right-secret\n")
    proc, address = _server(2, secret_file)
    captured: list[torch.Tensor] = []
    stolen: dict[str, Any] = {}
    try:
        _tapped(monkeypatch, lambda tensors: captured.append(tensors[0].clone()) or tensors)
        victim = RemoteBufferService(address, 0, 2, secret=b"right-secret", timeout=20)
        weights = victim.attach(victim.create("W_global", 4))
        victim.write(weights, torch.tensor([1.0, 2.0, 3.0, 4.0]))
        assert len(captured) == 1
        _tapped(monkeypatch, lambda tensors: [captured[0]])
        try:
            attacker = RemoteBufferService(address, 1, 2, secret=b"not-the-secret", timeout=20)
            found = attacker.attach(attacker.lookup("W_global"))
            stolen["read"] = attacker.read(found, torch.zeros(4)).tolist()
            attacker.write(found, torch.full((4,), -666.0))
            attacker.close()
        except PermissionError as exc:
            stolen["refused"] = str(exc)
        values = victim.read(weights, torch.zeros(4)).tolist()
        victim.close()
    finally:
        out, err = _finish(proc)
    assert "read" not in stolen and "refused" in stolen, stolen
    assert values == [1.0, 2.0, 3.0, 4.0], values
    assert ("client 1 (announced address 127.0.0.1) refused: its proof of the shared secret (connection 2) is a "
            "replay of connection 1's") in err, err
    assert "0 accumulations applied, 1 requests refused" in out, out + err


# -- 2b. a fake server ------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("fake_secret", [None, b"the-attackers-own"], ids=["no-secret", "another-secret"])
def test_a_worker_refuses_a_server_that_cannot_prove_the_secret(fake_secret: bytes | None) -> None:
    """A worker with the job's secret pointed at someone else's server (one that asks for
    no secret, or has a secret of its own) refuses it before it sends a buffer; before,
    it trusted a server that asked for no secret and wrote its weights there."""
    lines: list[str] = []
    fake = MemoryServer(1, bind="127.0.0.1", port=0, secret=fake_secret, timeout=10, log=lines.append)
    serving = threading.Thread(target=fake.serve, daemon=True)
    serving.start()
    outcome = "trusted"
    try:
        service = RemoteBufferService(fake.address, 0, 1, secret=b"the-jobs-secret", timeout=10)
        service.write(service.attach(service.create("W_global", 4)), torch.ones(4))
        service.close()
    except PermissionError as exc:
        outcome = str(exc)
    serving.join(10)
    assert outcome.startswith(f"worker 0 refused the memory server at {fake.address}: "), outcome
    assert ("asks for no shared secret" if fake_secret is None else "its proof of the shared secret is wrong") \
        in outcome, outcome
    assert not fake.buffers, "the worker sent the fake server a buffer"
    if fake_secret is not None:
        assert any("it found this server's proof wrong" in line for line in lines), lines


# -- 3. the job's own server's files, and another local user ----------------------------

@pytest.fixture
def tmp_dir(monkeypatch: pytest.MonkeyPatch):
    """A temporary folder like /tmp (every user may create files, sticky) for this test's
    processes alone (``TMPDIR``), so what they leave there is seen, and no one else's."""
    folder = Path(tempfile.mkdtemp(prefix="st-tmp-"))
    folder.chmod(0o1777)
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _left(folder: Path) -> list[str]:
    """What shmtrain left in a temporary folder (torch's own caches aside)."""
    return sorted(name for name in os.listdir(folder) if name.startswith("shmtrain"))


def _start_job_server(ctx: SimpleNamespace) -> tuple[str, bytes]:
    return Transports(ctx).memory_server()  # type: ignore[arg-type]


def _plant(path: Path, text: str) -> None:
    """``nobody`` writes ``text`` into ``path`` (another local user, before the job does)."""
    subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sh", "-c",
                    f"printf %s '{text}' > '{path}'"], check=True, timeout=10)
    assert path.stat().st_uid == NOBODY


@needs_root
@pytest.mark.timeout(60)
def test_another_users_address_file_does_not_point_the_job_at_its_server(tmp_dir: Path) -> None:
    """``nobody`` writes the address of its own server where rank 0 looked for its server's
    address (``$TMPDIR/shmtrain-smb-<pid>.log.addr``, a name anyone can predict): before,
    the job took it (a two-host job then gave the attacker 6,001 accumulations); now rank 0
    reads its server's address from a directory only it can enter, and leaves nothing in
    the temporary folder once the server has ended."""
    planted = tmp_dir / f"shmtrain-smb-{os.getpid()}.log.addr"
    attacker = "127.0.0.66:29666"
    _plant(planted, attacker)
    servers: set[int] = set()
    try:
        ctx = SimpleNamespace(store=dist.HashStore(), rank=0, world_size=1, timeout=30.0, rejoined=False)
        address, secret = _start_job_server(ctx)
        servers = {p.pid for p in psutil.Process().children() if "smb-server" in " ".join(p.cmdline())}
        assert address != attacker
        service = RemoteBufferService(address, 0, 1, secret=secret, timeout=20)
        weights = service.attach(service.create("W_global", 2))
        service.write(weights, torch.ones(2))
        assert service.read(weights, torch.zeros(2)).tolist() == [1.0, 1.0]
        service.close()
        _wait_gone(list(servers))
        assert _left(tmp_dir) == [planted.name], "a memory server's file or folder was left behind"
    finally:
        for pid in servers:
            if psutil.pid_exists(pid):
                psutil.Process(pid).kill()


_PREFORKED = """
import json, os, sys, time
import torch, torch.distributed as dist
from types import SimpleNamespace
from shmtrain.runtime.launch.smb_server import prefork
from shmtrain.fabric.smb.remote import RemoteBufferService
from shmtrain.fabric.transports import Transports
sys.stdin.readline()  # the attacker has planted its file
prefork(1, 30.0)
ctx = SimpleNamespace(store=dist.HashStore(), rank=0, world_size=1, timeout=30.0, rejoined=False)
address, secret = Transports(ctx).memory_server()
record = {"address": address}
try:
    service = RemoteBufferService(address, 0, 1, secret=secret, timeout=10)
    service.close()
except Exception as exc:
    record["error"] = str(exc)
deadline = time.monotonic() + 15
while time.monotonic() < deadline and os.waitpid(-1, os.WNOHANG) == (0, 0):
    time.sleep(0.05)  # the forked server ends with its client
print(json.dumps(record), flush=True)
"""


@needs_root
@pytest.mark.timeout(60)
def test_another_users_address_file_does_not_reach_a_forked_server(tmp_dir: Path) -> None:
    """The same for the server rank 0 forks before it joins (``prefork``, torchrun's path)."""
    child = subprocess.Popen([sys.executable, "-c", _PREFORKED], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    planted = tmp_dir / f"shmtrain-smb-{child.pid}.log.addr"
    attacker = "127.0.0.66:29666"
    try:
        _plant(planted, attacker)
        out, err = child.communicate("planted\n", timeout=50)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    record = json.loads(out.splitlines()[-1]) if out.strip() else {}
    assert record.get("address") not in (None, attacker) and "error" not in record, out + err
    assert _left(tmp_dir) == [planted.name], "a memory server's file or folder was left behind"


# -- 4. the job's own server's secret and the job's store -------------------------------

class _Recorder:
    """A store that keeps every value written to it (what a reader of the store could see)."""

    def __init__(self, store: dist.Store) -> None:
        self.store, self.written = store, []

    def set(self, key: str, value) -> None:
        self.written.append((key, value if isinstance(value, bytes) else str(value).encode()))
        self.store.set(key, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def secret_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    tempfile.tempdir = None  # the test's TMPDIR (a zygote may have read another)
    recorder = _Recorder(ctx.store)
    job = SimpleNamespace(store=recorder, rank=ctx.rank, world_size=ctx.world_size, timeout=30.0, rejoined=False)
    address, secret = _start_job_server(job)
    service = RemoteBufferService(address, ctx.rank, ctx.world_size, secret=secret, timeout=20)
    if ctx.rank == 0:
        service.write(service.attach(service.create("W_global", 2)), torch.ones(2))
    dist.barrier()
    service.close()
    if ctx.rank == 0:  # the server ends once both have said goodbye
        servers = [p.pid for p in psutil.Process().children() if "smb-server" in " ".join(p.cmdline())]
        _wait_gone(servers)
    return {"secret": secret.decode(), "written": [(k, v.decode(errors="replace")) for k, v in recorder.written]}


@pytest.mark.timeout(90)
def test_the_job_servers_secret_never_goes_through_the_jobs_store(tmp_dir: Path) -> None:
    """torchrun's store authenticates no one: anyone who reaches its port can read every
    key. Before, rank 0 wrote the secret there (``smb/auto``) for the other hosts; now it
    sends it over the job's gloo group: the store sees the address, never the secret."""
    results = launch("fabric.smb.test_security:secret_worker", 2, {}, timeout=80, env={"TMPDIR": str(tmp_dir)})
    secrets = {r["secret"] for r in results}
    assert len(secrets) == 1 and len(next(iter(secrets))) == 64, secrets
    secret = next(iter(secrets))
    written = [entry for r in results for entry in r["written"]]
    assert any(key == "smb/auto" for key, _ in written), written
    assert not [key for key, value in written if secret in value], "the secret was written to the job's store"
    assert _left(tmp_dir) == [], "a memory server's file or folder was left behind"


def test_a_kept_secret_is_found_by_its_rank_again_and_a_forged_folder_is_refused(tmp_dir: Path) -> None:
    """A worker's kept secret (for its host's next start) is read back by its rank and
    removed with its service; the store naming another folder of this user (anyone can
    write the store) gets a refusal, and that folder is neither read nor removed."""
    from shmtrain.fabric.shm.control import PeerFailure
    from shmtrain.fabric.smb import job_server

    store = dist.HashStore()
    job_server.keep_secret(store, 3, "10.0.0.1:1", b"s" * 64)
    folder = Path(store.get("smb/stash/3").decode())
    assert folder.parent == tmp_dir
    assert folder.stat().st_mode & 0o777 == 0o700 and (folder / "secret").stat().st_mode & 0o777 == 0o600
    assert job_server.kept_secret(store, 3, "10.0.0.1:1") == b"s" * 64  # rank 3 started again takes it over
    job_server.forget("10.0.0.1:1")
    assert _left(tmp_dir) == []
    mine = tmp_dir / "mine"
    mine.mkdir(mode=0o700)
    (mine / "secret").write_bytes(b"not a kept secret")
    (mine / "secret").chmod(0o600)
    store.set("smb/stash/3", str(mine))
    with pytest.raises(PeerFailure, match="rank 3 started again but cannot rejoin .* is not a folder of kept secrets"):
        job_server.kept_secret(store, 3, "10.0.0.1:1")
    job_server.forget("10.0.0.1:1")
    assert (mine / "secret").read_bytes() == b"not a kept secret"
