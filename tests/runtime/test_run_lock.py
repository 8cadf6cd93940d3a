"""One run per folder: a second run, or a ``--resume`` of a live run, is
refused with the holder's pid and host; the lock dies with its holder, so a killed run
resumes; metrics rows are whole lines however many writers append."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from pathlib import Path

import psutil
import pytest

from conftest import descendants
from shmtrain.runtime.checkpoint import files as checkpoint_files
from shmtrain.runtime.files import LineLog
from shmtrain.runtime.launch import runlock
from support.runs import LONG, SMALL, iterations_logged, rows_written, start, train, wait_for


def _gone(pids: list[int]) -> bool:
    return not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.timeout(240)
def test_a_second_run_and_a_resume_of_a_live_run_are_refused(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    first = start([*LONG, "--out", str(run)])
    try:
        wait_for(lambda: checkpoint_files.latest(run) is not None and rows_written(run, 1) > 150, first, "training")
        config_before = (run / "config.toml").read_bytes()
        for args, words in (([*SMALL, "--iterations", "5", "--out", str(run)], "another shmtrain run is using"),
                            (["--resume", str(run)], "is still going")):
            assert train(*args) == 2
            err = capsys.readouterr().err
            assert words in err and f"pid {first.pid} on host {socket.gethostname()}" in err, err
            assert str(run / runlock.LOCK_NAME) in err and "kill -INT" in err, err
        assert first.poll() is None  # the first run trains on, untouched
        assert (run / "config.toml").read_bytes() == config_before
        workers = descendants(first.pid)
        os.killpg(first.pid, signal.SIGINT)
        _, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert first.returncode == 130, err
    assert _gone(workers)
    stopped = checkpoint_files.step_of(checkpoint_files.resume_point(run, print))
    assert train("--resume", str(run)) == 0  # the first run, intact, continues to its end
    for rank in (0, 1):
        assert iterations_logged(run, rank) == list(range(1, 3001)), stopped
    assert json.loads((run / "summary.json").read_text())["iterations"] == 3000


@pytest.mark.timeout(240)
def test_a_killed_run_leaves_no_lock_behind(tmp_path: Path) -> None:
    run = tmp_path / "run"
    launcher = start([*LONG, "--out", str(run)])
    wait_for(lambda: checkpoint_files.latest(run) is not None and rows_written(run, 1) > 150, launcher, "training")
    workers = descendants(launcher.pid)
    os.kill(launcher.pid, signal.SIGKILL)  # the launcher alone: a crash; its workers die with it
    launcher.wait(timeout=30)
    deadline = 30
    while not _gone(workers) and deadline > 0:
        threading.Event().wait(0.1)
        deadline -= 0.1
    assert _gone(workers)
    assert (run / runlock.LOCK_NAME).exists()  # the file stays; the kernel dropped the lock
    assert train("--resume", str(run)) == 0
    for rank in (0, 1):
        assert iterations_logged(run, rank) == list(range(1, 3001))


def test_the_lock_is_held_until_released(tmp_path: Path) -> None:
    lock = runlock.acquire(tmp_path / "run", resume=False)
    pid, who = runlock.holder(tmp_path / "run" / runlock.LOCK_NAME)
    assert pid == str(os.getpid()) and socket.gethostname() in who
    with pytest.raises(ValueError, match=rf"--resume .*still going \(pid {os.getpid()} on host"):
        runlock.acquire(tmp_path / "run", resume=True)  # another descriptor: flock refuses it too
    lock.release()
    runlock.acquire(tmp_path / "run", resume=True).release()


def test_metrics_lines_stay_whole_with_concurrent_appenders(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.jsonl"
    LineLog(path, truncate=True).close()
    row = {"iteration": 0, "loss": 1.0, "time": {f"phase{i}": 0.001 * i for i in range(400)}}  # ~9 kB

    def append(writer: int) -> None:
        log = LineLog(path)
        for i in range(60):
            log.write(json.dumps({**row, "iteration": i, "writer": writer})[:-1])  # a line in pieces
            log.write("}\n")
        log.close()

    threads = [threading.Thread(target=append, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    lines = path.read_text().splitlines()
    assert len(lines) == 180
    rows = [json.loads(line) for line in lines]  # a torn line would not parse
    for writer in range(3):
        assert [r["iteration"] for r in rows if r["writer"] == writer] == list(range(60))


@pytest.mark.timeout(150)
def test_torchrun_is_refused_a_locked_folder(tmp_path: Path) -> None:
    """Under torchrun, rank 0 takes the same lock for the job: a folder another run holds
    (here this test process) is refused before anything is written there."""
    import subprocess

    from support.torchrun import TORCHRUN, env, free_port

    run = tmp_path / "run"
    with runlock.acquire(run, resume=False):
        cmd = TORCHRUN + ["--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                          "-m", "shmtrain", "train", *SMALL[2:], "--iterations", "5", "--out", str(run)]
        result = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=120)
    assert result.returncode != 0, result.stdout + result.stderr
    assert f"another shmtrain run is using {run} (pid {os.getpid()}" in result.stderr, result.stderr
    assert sorted(p.name for p in run.iterdir()) == [runlock.LOCK_NAME]  # nothing written
