"""A stand-alone memory server stopped (``kill -STOP``) under a training job for longer than
``--timeout``: the job ends within a few timeouts, blaming the server (not a worker), and
its checkpoints are intact: no unfinished ``.tmp`` folder, ``latest`` a whole one. A store
call that the stopped server would hold forever is ended by its watch
(``fabric/smb/stuck.py``)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from shmtrain.fabric.smb import stuck
from support.memory_server import finish_server, start_server
from support.runs import start, wait_for

pytestmark = pytest.mark.timeout(180)

JOB = ["--strategy", "seasgd", "--workers", "2", "--model", "mlp", "--data", "synthetic", "--samples", "256",
       "--input-shape", "1x8x8", "--batch-size", "8", "--no-progress", "--checkpoint-every", "50",
       "--timeout", "5", "--iterations", "1000000"]


def test_a_stopped_memory_server_ends_the_job_naming_it(tmp_path: Path) -> None:
    out = tmp_path / "run"
    server, address = start_server(2, "--out", str(tmp_path / "smb"))
    try:
        launcher = start([*JOB, "--smb-server", address, "--out", str(out)])
        try:
            wait_for(lambda: (out / "checkpoints" / "step-200").exists(), launcher, "checkpoint 200")
            os.kill(server.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            _, err = launcher.communicate(timeout=90)
            took = time.monotonic() - stopped
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        finish_server(server, wait=5)
    assert launcher.returncode == 1, err
    assert f"the memory server at {address} did not answer within" in err and "stalled" not in err, err
    assert took < 60, took
    checkpoints = out / "checkpoints"
    assert not list(checkpoints.glob("step-*.tmp")), sorted(p.name for p in checkpoints.iterdir())
    assert (checkpoints / (checkpoints / "latest").read_text().strip() / "meta.json").exists()


def test_a_call_that_never_returns_fails_the_process_naming_the_server(monkeypatch) -> None:
    failed: list[BaseException] = []
    monkeypatch.setattr(stuck, "_fatal", failed.append)
    watch = stuck.CallWatch("10.0.0.9:29600", 0.4)
    release = threading.Event()
    try:
        with watch.call("reading progress"):
            release.wait(1.5)  # a store call the server never answers
    finally:
        watch.close()
    assert len(failed) == 1 and "10.0.0.9:29600 did not answer within 1 s while reading progress" in str(failed[0])
    assert failed[0].server == "10.0.0.9:29600"
    quick = stuck.CallWatch("10.0.0.9:29600", 0.2)
    try:
        for _ in range(20):
            with quick.call("publishing progress"):
                time.sleep(0.02)  # each answered in time
    finally:
        quick.close()
    assert len(failed) == 1
