"""A one-host job lets no one else in: no socket but on loopback, nothing unpickled from a
store, segments and native code attached only if this user alone could have made them.

Each test makes the attack (another local user is ``nobody``, uid 65534: a child started
with ``setpriv``, or files given to it with ``chown``) and checks that it is refused
with its message or has no effect. They need root (to act as another user) and skip
with the reason elsewhere.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from shmtrain.fabric.shm.segment import SHM_DIR
from shmtrain.fabric.trust import UntrustedError
from shmtrain.runtime.launch.launcher import launch
from support.paths import SUPPORT

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="acting as another local user needs root and setpriv")


def _as_nobody(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv],
                            env=dict(os.environ, HOME="/tmp"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


@pytest.fixture
def shared_folder():
    """A folder both the victim and ``nobody`` can write (the attacker's report, the port)."""
    folder = Path(tempfile.mkdtemp(prefix="st-shared-"))
    folder.chmod(0o777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("listen", [False, True], ids=["train", "run"])
def test_another_local_user_cannot_plant_code_in_a_jobs_payload_or_results(shared_folder: Path,
                                                                           listen: bool) -> None:
    """The attacker writes pickles that would run code into every key of the job's store
    that a launcher or worker read them from, and into the launchers' folders: the
    workers get the real payload, the launcher the real results, and no code runs."""
    attacker = _as_nobody([sys.executable, str(SUPPORT / "security_targets.py"),
                           str(shared_folder), "3"])
    try:
        results = launch("support.security_targets:victim", 2, {"folder": str(shared_folder), "value": 42},
                         timeout=60, listen=listen)
        out = attacker.communicate(timeout=60)[0]
    finally:
        if attacker.poll() is None:
            attacker.kill()
            attacker.wait()
    report = json.loads((shared_folder / "report.json").read_text())
    assert results == [{"rank": 0, "value": 42}, {"rank": 1, "value": 42}], out[-2000:]
    assert not (shared_folder / "marker").exists(), f"the attacker's pickle ran: {report}"
    assert report["files"] == [], report  # the job's folder is closed to others
    # shmtrain train's store listens nowhere; shmtrain run's is on loopback, where the
    # attacker can write it, to no effect
    assert report["store"] == ("written" if listen else None), report


def _listening(pids: set[int]) -> set[str]:
    found = set()
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
            found.add(conn.laddr.ip)
    return found


@pytest.mark.timeout(120)
def test_a_one_host_train_listens_on_loopback_only(tmp_path: Path) -> None:
    """What ``ss -ltnp`` shows of a one-host ``shmtrain train`` while it trains: its
    processes listen on loopback alone (gloo's pairs; the job's store nowhere)."""
    proc = subprocess.Popen([sys.executable, "-m", "shmtrain", "train", "--workers", "2", "--iterations", "60",
                             "--model", "mlp", "--batch-size", "8", "--no-progress", "--out", str(tmp_path / "run")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: set[str] = set()
    try:
        while proc.poll() is None:
            try:
                family = {proc.pid, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))}
            except psutil.Error:
                break
            seen |= _listening(family)
            time.sleep(0.05)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert seen, "no listening socket was seen at all (gloo's pairs listen on loopback)"
    assert seen <= {"127.0.0.1", "::1"}, f"listening on {sorted(seen)}"


def _segment_as(name: str, uid: int, mode: int) -> Path:
    path = SHM_DIR / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    os.ftruncate(fd, 1 << 16)
    os.fchmod(fd, mode)
    os.fchown(fd, uid, uid)
    os.close(fd)
    return path


@pytest.mark.timeout(30)
@pytest.mark.parametrize("attack", ["other name", "same name, another user's", "same name, anyone's"])
def test_a_segment_another_user_planted_is_not_attached(attack: str) -> None:
    """Another local user writes the name of its own world-writable segment into the
    host's store, with a process and descriptor holding it (or announces the run's name
    for such a segment): local rank 1 refuses to attach it."""
    import secrets

    import torch.distributed as dist

    from shmtrain.fabric.shm.host import HostGroup

    prefix = f"shmtrain-{secrets.token_hex(4)}-h0"
    ours = f"{prefix}-0-control"
    planted = f"shmtrain-{secrets.token_hex(4)}-evil" if attack == "other name" else ours
    owner = os.geteuid() if attack == "same name, anyone's" else NOBODY
    path = _segment_as(planted, owner, 0o666)
    held = os.open(path, os.O_RDWR)  # where the announcement says the segment is open
    store = dist.HashStore()
    store.set("segment/0", f"{planted} {os.getpid()} {held}")
    try:
        with pytest.raises(UntrustedError) as refused:
            HostGroup(store, 1, 2, prefix, None, timeout=2.0)
    finally:
        os.close(held)
        path.unlink()
    message = str(refused.value)
    if attack == "other name":
        assert planted in message and ours in message and "someone other than local rank 0" in message
    elif owner == NOBODY:
        assert "is owned by nobody (uid 65534)" in message and "refused" in message
    else:
        assert "has mode 0666: others can open it" in message


@pytest.mark.timeout(60)
def test_native_code_in_a_cache_folder_others_can_write_is_not_loaded(tmp_path: Path) -> None:
    """The compiled pipeline is loaded (its code runs) only from a folder no one else can
    write: in a world-writable SHMTRAIN_CACHE it is refused with the reason."""
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    probe = ("from shmtrain.fabric import native; lib = native.library(); "
             "print('loaded' if lib else native.why_not)")
    done = subprocess.run([sys.executable, "-c", probe], env=dict(os.environ, SHMTRAIN_CACHE=str(cache)),
                          capture_output=True, text=True, timeout=50)
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: nothing is built or loaded")
    assert done.stdout.strip() == f"{cache} is not owned by this user or is writable by others; remove it, " \
                                  "or set SHMTRAIN_CACHE to a folder of your own", done.stdout + done.stderr
    cache.chmod(0o700)
    done = subprocess.run([sys.executable, "-c", probe], env=dict(os.environ, SHMTRAIN_CACHE=str(cache)),
                          capture_output=True, text=True, timeout=50)
    assert done.stdout.strip() == "loaded", done.stdout + done.stderr
