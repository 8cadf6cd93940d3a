"""Exit paths: a worker killed with SIGKILL, Ctrl-C; nothing may leak or hang."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import descendants, new_segments, worker_process


def start_long_run(out: Path) -> subprocess.Popen:
    env = dict(os.environ, SHMTRAIN_NO_PROGRESS="1")
    return subprocess.Popen(
        [sys.executable, "-m", "shmtrain", "train", "--workers", "3", "--iterations", "100000",
         "--timeout", "60", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )


def wait_for_training(out: Path, launcher: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = out / "metrics" / "rank-2.jsonl"
        if rows.exists() and rows.stat().st_size > 500:
            return
        assert launcher.poll() is None, launcher.communicate()
        time.sleep(0.2)
    raise AssertionError("training did not start")


def worker_pid(launcher: subprocess.Popen, rank: int) -> int:
    return worker_process(launcher.pid, rank).pid


def assert_all_gone(launcher: subprocess.Popen, workers: list[int]) -> None:
    assert not [pid for pid in workers
                if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not new_segments(), new_segments()


def test_sigkill_of_a_worker_fails_the_run_naming_it(tmp_path: Path) -> None:
    launcher = start_long_run(tmp_path / "run")
    wait_for_training(tmp_path / "run", launcher)
    workers = descendants(launcher.pid)
    victim = worker_pid(launcher, 1)
    started = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    _, err = launcher.communicate(timeout=60)
    assert time.monotonic() - started < 30
    assert launcher.returncode == 1
    assert "worker rank 1" in err and "SIGKILL" in err, err
    assert_all_gone(launcher, workers)


# runtime/checkpoint/test_checkpoint.py's Ctrl-C (exit 130, every worker gone, no segment) runs by default
@pytest.mark.slow  # ~17 s
def test_ctrl_c_stops_every_worker_and_cleans_up(tmp_path: Path) -> None:
    launcher = start_long_run(tmp_path / "run")
    wait_for_training(tmp_path / "run", launcher)
    workers = descendants(launcher.pid)
    os.killpg(launcher.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 130, err
    assert "interrupted" in err
    assert_all_gone(launcher, workers)


def test_sigkill_of_the_launcher_takes_the_workers_down(tmp_path: Path) -> None:
    launcher = start_long_run(tmp_path / "run")
    wait_for_training(tmp_path / "run", launcher)
    workers = descendants(launcher.pid)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in workers):
        time.sleep(0.2)
    assert not [p for p in workers if psutil.pid_exists(p)]
    assert not new_segments(), new_segments()


# killed workers whose peers train on: runtime/hosts/test_lost_host_survivors.py (hsgd, a whole host) by default
@pytest.mark.slow  # ~15 s
def test_sigkill_of_an_async_worker_lets_the_others_finish(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = dict(os.environ, SHMTRAIN_NO_PROGRESS="1")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "shmtrain", "train", "--strategy", "seasgd", "--workers", "3",
         "--iterations", "400", "--timeout", "60", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )
    wait_for_training(out, launcher)
    workers = descendants(launcher.pid)
    os.kill(worker_pid(launcher, 2), signal.SIGKILL)
    stdout, err = launcher.communicate(timeout=150)
    assert launcher.returncode == 1
    assert "worker rank 2" in err and "SIGKILL" in err, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workers_finished"] == 2 and summary["accuracy"] is not None
    rows = [json.loads(r) for r in (out / "metrics" / "rank-0.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["eval"]["loss"] if "eval" in r else r["loss"]) for r in rows)
    assert_all_gone(launcher, workers)
