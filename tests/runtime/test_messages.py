"""Every message of the fourth reliability list made right: the cause, the file or option,
the fix, the documented exit status, and no traceback."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import psutil
import pytest

from conftest import descendants, worker_process
from shmtrain.runtime.checkpoint import files as checkpoint_files
from shmtrain.runtime.launch.launcher import shm_note
from support.runs import LONG, SMALL, iterations_logged, rows_written, start, train, wait_for

SHORT = [*SMALL, "--iterations", "20", "--checkpoint-every", "10", "--eval-every", "10"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished run with step-10 and step-20."""
    run = tmp_path_factory.mktemp("finished") / "run"
    assert train(*SHORT, "--out", str(run)) == 0
    return run


def copy_of(run: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run, target)
    return target


# -- checkpoint files ------------------------------------------------------------------------
def test_a_meta_record_without_crc32_falls_back_to_the_previous_checkpoint(finished: Path, tmp_path: Path,
                                                                             capsys) -> None:
    run = copy_of(finished, tmp_path)
    meta_file = run / "checkpoints" / "step-20" / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["ranks"][1]["crc32"]
    meta_file.write_text(json.dumps(meta))
    assert train("--resume", str(run)) == 0
    err = capsys.readouterr().err
    assert str(meta_file) in err and "ranks[1] has no 'crc32'" in err and "falling back" in err, err
    assert "Traceback" not in err and (run / "checkpoints" / "step-20.corrupt").is_dir()
    assert iterations_logged(run, 0) == list(range(1, 21))  # 11-20 trained again from step-10


def test_a_binary_latest_pointer_is_rewritten(finished: Path, tmp_path: Path, capsys) -> None:
    run = copy_of(finished, tmp_path)
    (run / "checkpoints" / "latest").write_bytes(b"\xff\xfe\x00\x9c step-99\n")
    assert train("--resume", str(run), "--iterations", "30") == 0
    assert "codec" not in capsys.readouterr().err
    assert (run / "checkpoints" / "latest").read_text() == "step-30\n"


def test_a_config_file_that_is_not_utf8_is_named(tmp_path: Path, capsys) -> None:
    config = tmp_path / "run.toml"
    config.write_bytes(b"lr = 0.1\n# caf\xe9\n")
    assert train("--config", str(config), "--out", str(tmp_path / "run")) == 2
    err = capsys.readouterr().err
    assert f"--config {config} is not UTF-8 text (byte 14 is 0xe9)" in err and "codec" not in err, err


@pytest.mark.parametrize("case", ["none", "unfinished", "damaged"])
def test_a_resume_without_a_checkpoint_says_why(case: str, finished: Path, tmp_path: Path, capsys) -> None:
    run = copy_of(finished, tmp_path)
    folder = run / "checkpoints"
    if case == "damaged":
        for meta in folder.glob("step-*/meta.json"):
            meta.write_text("{")
    else:
        for step in folder.glob("step-*"):
            shutil.rmtree(step)
        if case == "unfinished":
            (folder / "step-10.tmp").mkdir()
    assert train("--resume", str(run)) == 2
    err = capsys.readouterr().err
    assert f"--resume {run}: no complete checkpoint in {folder}" in err, err
    why = {"none": "the run ended before its first one",
           "unfinished": "the run ended while writing its first one (step-10.tmp is unfinished)",
           "damaged": "every one was damaged (step-10, step-20"}[case]
    assert why in err, err
    assert err.count("ended before its first one") == (case == "none")


def test_resuming_a_finished_run_keeps_its_eval_rows_and_wall_time(finished: Path, tmp_path: Path) -> None:
    run = copy_of(finished, tmp_path)
    before = json.loads((run / "summary.json").read_text())
    rows_before = (run / "metrics" / "rank-0.jsonl").read_text()
    assert train("--resume", str(run)) == 0
    assert (run / "metrics" / "rank-0.jsonl").read_text() == rows_before  # no second eval row
    after = json.loads((run / "summary.json").read_text())
    changed = {k for k in after if after[k] != before.get(k)}
    assert changed <= {"stretches", "wall_s"}, changed  # accuracy, evaluations, iterations: as they were
    # wall_s is not overwritten by the no-op launch's: it is every stretch's sum (runtime/outputs/stretches.py)
    assert after["wall_s"] >= before["wall_s"] and after["stretches"][-1]["start_iteration"] == \
        after["stretches"][-1]["end_iteration"] == before["iterations"]


# -- signals ---------------------------------------------------------------------------------
@pytest.mark.slow  # ~60 s of CPU: Ctrl-C at many moments of a start
@pytest.mark.timeout(120)
def test_ctrl_c_while_starting_prints_no_traceback(tmp_path: Path) -> None:
    for delay in (0.3, 0.8, 1.5):
        launcher = start([*SMALL, "--iterations", "2000", "--out", str(tmp_path / f"run-{delay}")])
        time.sleep(delay)
        os.killpg(launcher.pid, signal.SIGINT)
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode in (130, 0), (delay, err)
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, (delay, err)
        assert launcher.returncode == 0 or "interrupted by SIGINT" in err, (delay, err)


@pytest.mark.timeout(120)
def test_a_second_sigterm_exits_143_and_says_what_is_saved(tmp_path: Path) -> None:
    run = tmp_path / "run"
    launcher = start([*LONG, "--out", str(run)])
    wait_for(lambda: checkpoint_files.latest(run) is not None and rows_written(run, 1) > 150, launcher, "training")
    os.kill(launcher.pid, signal.SIGTERM)
    # the second while the workers still stop: apart enough not to merge with the first
    # (the launcher sleeps in a select that the first interrupts), well within the stop,
    # which has taken under 50 ms since a worker's loader ends at once
    time.sleep(0.005)
    os.kill(launcher.pid, signal.SIGTERM)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 143, err
    assert "stopped at once by a second signal (SIGTERM, after SIGTERM)" in err, err
    assert "without saving" not in err and "Traceback" not in err, err
    named = err.split("the latest complete checkpoint is ")[1].split(";")[0]
    assert checkpoint_files.validate(Path(named))["step"] == checkpoint_files.step_of(named)
    assert f"shmtrain train --resume {run}" in err


@pytest.mark.timeout(120)
def test_a_killed_zygote_is_named_with_a_resume_hint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    launcher = start([*LONG, "--out", str(run)])
    wait_for(lambda: checkpoint_files.latest(run) is not None and rows_written(run, 1) > 150, launcher, "training")
    workers = descendants(launcher.pid)
    zygote = next(p for p in workers if "shmtrain.runtime.launch.zygote" in " ".join(psutil.Process(p).cmdline()))
    os.kill(zygote, signal.SIGKILL)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 1, err
    assert f"the worker zygote (pid {zygote}" in err and "died (killed by SIGKILL)" in err, err
    assert "worker rank 0 (pid" not in err and f"continue with: shmtrain train --resume {run}" in err, err
    deadline = time.monotonic() + 30  # the workers end with their zygote (their death signal)
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in workers):
        time.sleep(0.1)
    assert train("--resume", str(run)) == 0


@pytest.mark.slow  # ~26 s of CPU; the killed zygote's message runs by default
@pytest.mark.timeout(150)
def test_a_killed_zygote_restarts_with_max_restarts(tmp_path: Path) -> None:
    run = tmp_path / "run"
    launcher = start([*LONG, "--max-restarts", "1", "--out", str(run)])
    wait_for(lambda: checkpoint_files.latest(run) is not None and rows_written(run, 1) > 150, launcher, "training")
    zygote = next(p for p in descendants(launcher.pid)
                  if "shmtrain.runtime.launch.zygote" in " ".join(psutil.Process(p).cmdline()))
    os.kill(zygote, signal.SIGKILL)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, err
    assert f"the worker zygote (pid {zygote}" in err and "restarting every worker from" in err, err
    for rank in (0, 1):
        assert iterations_logged(run, rank) == list(range(1, 3001))


@pytest.mark.timeout(120)
def test_a_sigbus_names_dev_shm(tmp_path: Path) -> None:
    assert "/dev/shm" in shm_note(-signal.SIGBUS) and shm_note(-signal.SIGKILL) == ""
    run = tmp_path / "run"
    launcher = start([*LONG, "--out", str(run)])
    wait_for(lambda: rows_written(run, 1) > 50, launcher, "training")
    victim = worker_process(launcher.pid, 1)
    os.kill(victim.pid, signal.SIGBUS)  # what touching a page of a full /dev/shm does
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 1, err
    assert "killed by SIGBUS" in err and "/dev/shm is full" in err and "--force" in err, err
