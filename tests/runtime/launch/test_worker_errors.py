"""Errors only a worker can meet, and signals to the launcher: one
line at the terminal naming the root cause (the rank, the path, the signal), the full
traceback in ``RUN_DIR/logs/rank-<r>.log``; ``--skip-bad-files``; a stalled worker is
the one blamed; SIGHUP and SIGTERM stop the workers before the launcher exits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import psutil
import pytest
from PIL import Image

from conftest import descendants, run_main, worker_process, worker_rank
from shmtrain.cli import main
from support.runs import SMALL, rows_written, start, wait_for


def image_folder(root: Path, bad: str | None = None) -> Path:
    """Two classes of 30 small PNGs; ``bad`` (e.g. ``c1/029.png``) is not an image. It sorts
    last in its class, so the pre-flight's sample of each class does not meet it."""
    rng = np.random.default_rng(0)
    for c in range(2):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(30):
            Image.fromarray((rng.random((8, 8, 3)) * 255).astype("uint8")).save(root / f"c{c}" / f"{i:03d}.png")
    if bad:
        (root / bad).write_bytes(b"this is not a png")
    return root


def train_cli(*args: str) -> subprocess.CompletedProcess:
    return run_main("train", *args)


FOLDER = ["--image-size", "8", "--model", "mlp", "--workers", "2", "--iterations", "4", "--batch-size", "8",
          "--no-progress"]


def test_a_corrupt_image_deep_in_the_data_is_one_line_and_the_traceback_is_in_the_log(tmp_path: Path) -> None:
    data = image_folder(tmp_path / "data", bad="c1/029.png")
    run = tmp_path / "run"
    done = train_cli("--data", str(data), *FOLDER, "--out", str(run))
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    error = [line for line in done.stderr.splitlines() if line.startswith("shmtrain: error:")]
    assert len(error) == 1, done.stderr
    line = error[0]
    assert "worker rank" in line and str(data / "c1" / "029.png") in line and "--skip-bad-files" in line, line
    rank = int(line.split("worker rank ")[1].split()[0])
    log = run / "logs" / f"rank-{rank}.log"
    assert str(log) in line
    assert "Traceback" in log.read_text() and "029.png" in log.read_text()


def test_verbose_copies_the_worker_logs_to_the_terminal(tmp_path: Path) -> None:
    data = image_folder(tmp_path / "data", bad="c1/029.png")
    done = train_cli("--data", str(data), *FOLDER, "--out", str(tmp_path / "run"), "--verbose")
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "UnidentifiedImageError" in done.stderr
    assert (tmp_path / "run" / "logs" / "rank-0.log").read_text().count("Traceback") >= 1


def test_skip_bad_files_trains_and_counts_them(tmp_path: Path, capsys) -> None:
    data = image_folder(tmp_path / "data", bad="c0/000.png")  # first of its class: the pre-flight samples it
    run = tmp_path / "run"
    assert main(["train", "--data", str(data), *FOLDER, "--out", str(run)]) == 2  # the pre-flight, in this process
    refused = capsys.readouterr().err
    assert "000.png" in refused and not run.exists(), refused
    with pytest.warns(UserWarning, match=r"skipped \(--skip-bad-files\): --data: image .*000\.png"):  # the pre-flight
        done = train_cli("--data", str(data), *FOLDER, "--out", str(run), "--skip-bad-files")
    assert done.returncode == 0, done.stderr
    assert json.loads((run / "summary.json").read_text())["skipped_files"] == 1
    assert "skipped 1 unreadable image" in done.stdout
    assert "000.png" in (run / "logs" / "rank-0.log").read_text()


def _worker(launcher: subprocess.Popen, rank: int) -> psutil.Process:
    return worker_process(launcher.pid, rank)


def test_a_stalled_worker_is_blamed_not_the_one_that_gave_up(tmp_path: Path) -> None:
    run = tmp_path / "run"
    launcher = start([*SMALL, "--iterations", "200000", "--timeout", "3", "--out", str(run)])
    wait_for(lambda: rows_written(run, 1) > 20, launcher, "training")
    stalled = _worker(launcher, 1)
    stalled.suspend()  # SIGSTOP: alive, never answers
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert f"worker rank 1 (pid {stalled.pid}) stalled" in last, err
    assert "worker rank 0 gave up waiting for it" in last and "SIGKILL" in last, last
    assert not psutil.pid_exists(stalled.pid) or stalled.status() == psutil.STATUS_ZOMBIE


def test_a_killed_worker_is_named_with_its_signal(tmp_path: Path) -> None:
    run = tmp_path / "run"
    launcher = start([*SMALL, "--iterations", "200000", "--out", str(run)])
    wait_for(lambda: rows_written(run, 1) > 20, launcher, "training")
    victim = _worker(launcher, 1)
    victim.kill()
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert f"worker rank 1 (pid {victim.pid}) failed: killed by SIGKILL" in last, err
    assert "code 255" not in err and "Traceback" not in err


@pytest.mark.parametrize("signum, code", [(signal.SIGHUP, 129), (signal.SIGTERM, 143)])
def test_hangup_and_terminate_stop_every_worker_before_the_launcher_exits(signum: int, code: int,
                                                                         tmp_path: Path) -> None:
    run = tmp_path / "run"
    launcher = start([*SMALL, "--iterations", "200000", "--checkpoint-every", "0", "--out", str(run)])
    wait_for(lambda: rows_written(run, 1) > 20, launcher, "training")
    workers = [psutil.Process(p) for p in descendants(launcher.pid)]
    assert len([p for p in workers if worker_rank(p) is not None]) == 2
    os.kill(launcher.pid, signum)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == code, err
    assert signal.Signals(signum).name in err.strip().splitlines()[-1], err
    gone, alive = psutil.wait_procs(workers, timeout=0)
    assert not alive, [p.pid for p in alive]


def test_a_peer_that_noticed_the_death_first_is_not_blamed() -> None:
    """The race the launcher loses when a peer finds the SIGKILLed rank dead before the
    launcher's poll: rank 0 exits first, but its record names rank 1 as the cause."""
    from types import SimpleNamespace

    from shmtrain.runtime.launch.failures import root_cause
    from shmtrain.runtime.launch.job_dir import JobDir
    from shmtrain.runtime.outputs.worker_logs import WorkerLogs

    children = [SimpleNamespace(pid=100, returncode=1), SimpleNamespace(pid=101, returncode=-signal.SIGKILL)]
    record = {"cause": "local rank 1 (pid 101) died while this worker waited for gradients", "peer": 1,
              "timeout": False}
    job = JobDir.make()
    try:
        failure = root_cause(children, 0, 1, record, [], {}, WorkerLogs(None, 2, False), job)
        assert str(failure) == "worker rank 1 (pid 101) failed: killed by SIGKILL" and failure.rank == 1
        # its own error, when it had one, is the cause
        job.put_error(1, {"cause": "ValueError: bad", "peer": None, "timeout": False})
        children[1].returncode = 1
        failure = root_cause(children, 0, 1, record, [], {}, WorkerLogs(None, 2, False), job)
        assert str(failure) == "worker rank 1 (pid 101) failed: ValueError: bad"
    finally:
        job.remove()
