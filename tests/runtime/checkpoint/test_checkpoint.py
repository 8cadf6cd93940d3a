"""Long runs: checkpoints, ``--resume``, stops that save (Ctrl-C, SIGTERM), restarts after
a worker's death (``--max-restarts``), and bad input (a conflicting configuration, an
unwritable run folder, a corrupt checkpoint)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
import torch.distributed as dist

from conftest import descendants, worker_process
from shmtrain.runtime.checkpoint import files as checkpoint_files
from shmtrain.runtime.checkpoint.checkpointer import Checkpointer
from shmtrain.runtime.checkpoint.files import CheckpointError
from shmtrain.runtime.config import resolve
from support.runs import (
    LONG,
    SMALL,
    assert_same_weights,
    iterations_logged,
    rows_written,
    start,
    train,
    wait_for,
    weights,
)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The uninterrupted run of LONG, which the interrupted ones must equal."""
    run = tmp_path_factory.mktemp("straight") / "run"
    assert train(*LONG, "--out", str(run)) == 0
    return run


# -- exact resume -------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["ssgd", pytest.param("gpi", marks=pytest.mark.slow)])
def test_resume_equals_the_straight_run(strategy: str, tmp_path: Path) -> None:
    common = [*SMALL, "--strategy", strategy, "--checkpoint-every", "10"]
    assert train(*common, "--iterations", "60", "--out", str(tmp_path / "straight")) == 0
    assert train(*common, "--iterations", "30", "--out", str(tmp_path / "run")) == 0
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step-30"
    assert train("--resume", str(tmp_path / "run"), "--iterations", "60") == 0
    run = tmp_path / "run"
    assert_same_weights(weights(run / "model.pt"), weights(tmp_path / "straight" / "model.pt"))
    for rank in (0, 1):
        a = torch.load(run / "checkpoints" / "step-60" / f"rank-{rank}.pt", weights_only=False)
        b = torch.load(tmp_path / "straight" / "checkpoints" / "step-60" / f"rank-{rank}.pt", weights_only=False)
        assert_same_weights(a["model"], b["model"])
        assert a["train"]["iteration"] == 60 and a["strategy"]["iteration"] == 60
        assert iterations_logged(run, rank) == list(range(1, 61))  # appended, none twice
    # the layout: the newest --keep-checkpoints (2) complete folders, latest, nothing partial
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["latest", "step-50", "step-60"], names
    meta = json.loads((run / "checkpoints" / "step-60" / "meta.json").read_text())
    assert meta["world"] == 2 and [r["iteration"] for r in meta["ranks"]] == [60, 60]
    assert "iterations = 60" in (run / "config.toml").read_text()
    assert json.loads((run / "summary.json").read_text())["iterations"] == 60


def test_seasgd_resume_continues_from_the_saved_global_weights(tmp_path: Path) -> None:
    """One worker: the exchange with W_g is then deterministic, so continuing from the
    saved W_g (and nothing else) gives the straight run's weights; two workers train on."""
    common = [*SMALL, "--strategy", "seasgd", "--workers", "1", "--checkpoint-every", "0"]
    assert train(*common, "--iterations", "40", "--out", str(tmp_path / "straight")) == 0
    assert train(*common, "--iterations", "20", "--out", str(tmp_path / "run")) == 0
    saved = torch.load(tmp_path / "run" / "checkpoints" / "step-20" / "rank-0.pt", weights_only=False)
    assert saved["strategy"]["global_weights"].numel() == sum(v.numel() for v in saved["model"].values())
    assert train("--resume", str(tmp_path / "run"), "--iterations", "40") == 0
    assert_same_weights(weights(tmp_path / "run" / "model.pt"), weights(tmp_path / "straight" / "model.pt"))
    after = torch.load(tmp_path / "run" / "checkpoints" / "step-40" / "rank-0.pt", weights_only=False)
    assert not torch.equal(after["strategy"]["global_weights"], saved["strategy"]["global_weights"])


@pytest.mark.slow
def test_seasgd_two_workers_stop_and_resume(tmp_path: Path) -> None:
    """An asynchronous run stopped by SIGTERM to the launcher alone (relayed through the
    control block) saves one checkpoint from both workers and resumes to the end."""
    run = tmp_path / "run"
    launcher = start([*SMALL, "--strategy", "seasgd", "--iterations", "4000", "--checkpoint-every", "0",
                      "--out", str(run)])
    wait_for(lambda: rows_written(run, 1) > 100, launcher, "training")
    os.kill(launcher.pid, signal.SIGTERM)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 143, err
    assert "SIGTERM" in err and f"shmtrain train --resume {run}" in err, err
    point = checkpoint_files.resume_point(run, print)
    assert point is not None and "global_weights" in torch.load(point / "rank-0.pt", weights_only=False)["strategy"]
    assert train("--resume", str(run)) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["accuracy"] is not None and summary["workers_finished"] == 2


# -- stops and restarts ---------------------------------------------------------------------------
def test_ctrl_c_saves_and_the_resume_equals_the_straight_run(straight: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    launcher = start([*LONG, "--out", str(run)])
    wait_for(lambda: rows_written(run, 1) > 200, launcher, "training")
    workers = descendants(launcher.pid)
    sent = time.monotonic()
    os.killpg(launcher.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 130, err
    assert time.monotonic() - sent < 15
    assert "interrupted" in err and f"shmtrain train --resume {run}" in err, err
    assert not [p for p in workers if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    point = checkpoint_files.resume_point(run, print)
    stopped_at = checkpoint_files.step_of(point)
    assert 200 < stopped_at < 3000 and iterations_logged(run, 1)[-1] == stopped_at
    assert not (run / "model.pt").exists()  # the run is not finished
    assert train("--resume", str(run)) == 0
    assert_same_weights(weights(run / "model.pt"), weights(straight / "model.pt"))
    assert_same_weights(weights(run / "checkpoints" / "step-3000"), weights(straight / "checkpoints" / "step-3000"))
    assert iterations_logged(run, 0) == list(range(1, 3001))
    summary = json.loads((run / "summary.json").read_text())  # both stretches, the whole wall time
    assert [(s["start_iteration"], s["end_iteration"], s["ended"]) for s in summary["stretches"]] == [
        (0, stopped_at, "interrupted"), (stopped_at, 3000, "finished")]
    assert summary["wall_s"] == pytest.approx(sum(s["wall_s"] for s in summary["stretches"]), abs=0.01)


def test_killed_worker_restarts_from_the_latest_checkpoint(tmp_path: Path) -> None:
    """A strategy that does not recover in place (ps_weight: each worker's momentum is its
    own, and no survivor holds the dead one's) restarts every worker from the latest
    checkpoint."""
    job = [*LONG, "--strategy", "ps_weight"]
    straight = tmp_path / "straight"
    assert train(*job, "--out", str(straight)) == 0
    run = tmp_path / "run"
    launcher = start([*job, "--max-restarts", "1", "--out", str(run)])
    wait_for(lambda: checkpoint_files.latest(run) is not None and rows_written(run, 1) > 300, launcher, "a checkpoint")
    victim = worker_process(launcher.pid, 1)
    os.kill(victim.pid, signal.SIGKILL)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, err
    assert f"worker rank 1 (pid {victim.pid})" in err and "SIGKILL" in err, err
    assert "restarting every worker from" in err and "restart 1 of 1" in err, err
    assert_same_weights(weights(run / "model.pt"), weights(straight / "model.pt"))
    for rank in (0, 1):
        assert iterations_logged(run, rank) == list(range(1, 3001))


# -- bad input and faults -----------------------------------------------------------------------------
def test_corrupt_checkpoint_falls_back_to_the_previous_one(straight: Path, tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    (run / "model.pt").unlink()
    damaged = run / "checkpoints" / "step-3000" / "rank-1.pt"
    damaged.write_bytes(damaged.read_bytes()[:1000])  # truncated
    assert train("--resume", str(run)) == 0
    err = capsys.readouterr().err
    assert str(damaged) in err and "truncated" in err and "falling back" in err, err
    assert (run / "checkpoints" / "step-3000.corrupt").is_dir()
    # the fallback (step-2900) trained the last 100 iterations again, to the same weights
    assert_same_weights(weights(run / "model.pt"), weights(straight / "model.pt"))


def test_a_corrupt_file_is_named(straight: Path, tmp_path: Path, capsys) -> None:
    folder = tmp_path / "step-3000"
    shutil.copytree(straight / "checkpoints" / "step-3000", folder)
    file = folder / "rank-0.pt"
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=re.escape(str(file))):
        checkpoint_files.load_rank(folder, 0, 2)
    with pytest.raises(CheckpointError, match="holds 2 ranks, this job has 4"):
        checkpoint_files.load_rank(folder, 1, 4)
    # every checkpoint damaged: a clear error, exit 2
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    for meta in (run / "checkpoints").glob("step-*/meta.json"):
        meta.write_text("{")
    assert train("--resume", str(run)) == 2
    err = capsys.readouterr().err
    assert "meta.json" in err and "no complete checkpoint" in err, err


@pytest.mark.parametrize(("flags", "words"), [
    (["--batch-size", "16"], ["--batch-size 16", "batch-size = 8"]),
    (["--workers", "3"], ["--workers 3", "workers = 2"]),
    (["--strategy", "gpi"], ["--strategy 'gpi'", "strategy = 'ssgd'"]),
    (["--model", "smallcnn"], ["--model 'smallcnn'", "model = 'mlp'"]),
    (["--iterations", "10"], ["--iterations 10", "done 3000", "--iterations 3000 or more"]),
])
def test_conflicting_resume_is_refused(straight: Path, flags: list[str], words: list[str], capsys) -> None:
    started = time.monotonic()
    assert train("--resume", str(straight), *flags) == 2
    assert time.monotonic() - started < 10  # before any worker
    err = capsys.readouterr().err
    for word in words:
        assert word in err, (word, err)


def test_checkpoint_config_must_match(straight: Path) -> None:
    other = resolve({**straight_values(straight), "lr": 0.5})
    with pytest.raises(ValueError, match="lr = 0.05, this run has lr = 0.5"):
        checkpoint_files.check_compatible(straight / "checkpoints" / "step-3000", other)


def straight_values(run: Path) -> dict:
    from shmtrain.runtime.config import read_toml

    return read_toml(str(run / "config.toml"))


def test_out_with_checkpoints_needs_resume(straight: Path, capsys) -> None:
    assert train(*LONG, "--out", str(straight)) == 2
    err = capsys.readouterr().err
    assert "already holds a run with checkpoints" in err and f"--resume {straight}" in err


def test_unwritable_run_folder_is_refused_before_training(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("a file where the checkpoints folder goes")
    started = time.monotonic()
    assert train(*SMALL, "--iterations", "5", "--out", str(run)) == 2
    assert time.monotonic() - started < 10
    err = capsys.readouterr().err
    assert f"--out {run}" in err and "cannot be written" in err and "checkpoints" in err, err


def test_a_failed_write_names_the_path_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    ctx = SimpleNamespace(rank=0, world_size=1, store=dist.HashStore())
    config = resolve({"workers": 1, "strategy": "single", "keep_checkpoints": 2})
    saver = Checkpointer(ctx, config, tmp_path, steps_per_epoch=10)
    trainer = SimpleNamespace(state=SimpleNamespace(iteration=10),
                              state_dict=lambda copy=True: {"model": {"w": torch.ones(3)}, "train": {"iteration": 10}})
    saver.save(trainer, 10)
    (tmp_path / "checkpoints" / "step-20.tmp").write_text("in the way")  # mkdir fails mid-run
    with pytest.raises(CheckpointError) as exc:
        saver.save(trainer, 20)
    message = str(exc.value)
    assert str(tmp_path / "checkpoints" / "step-20.tmp") in message and "step-10 is intact" in message
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-10"
    assert checkpoint_files.validate(tmp_path / "checkpoints" / "step-10")["step"] == 10


def test_second_signal_stops_at_once_and_duplicates_do_not() -> None:
    from shmtrain.runtime.train.stop import DUPLICATE_S, StopRequest

    requests = []
    control = SimpleNamespace(request_stop=requests.append)
    stop = StopRequest.__new__(StopRequest)
    stop.control, stop._parent, stop._received = control, os.getppid(), None
    stop._handle(signal.SIGINT, None)
    stop._handle(signal.SIGINT, None)  # the same Ctrl-C relayed (torchrun's agent): ignored
    assert requests == [signal.SIGINT]
    stop._received -= DUPLICATE_S + 0.1
    with pytest.raises(KeyboardInterrupt):
        stop._handle(signal.SIGINT, None)
    with pytest.raises(SystemExit) as exc:
        stop._handle(signal.SIGTERM, None)
    assert exc.value.code == 143


@pytest.mark.slow
def test_torchrun_resumes_a_run_folder_with_a_checkpoint(tmp_path: Path) -> None:
    """Under torchrun, ``--out DIR`` with a checkpoint resumes (what torchrun's own
    --max-restarts relies on): 30 iterations locally, then torchrun to 60."""
    from support.torchrun import TORCHRUN, env, free_port

    common = [*SMALL, "--checkpoint-every", "10"]  # SMALL starts with --workers 2
    assert train(*common, "--iterations", "60", "--out", str(tmp_path / "straight")) == 0
    assert train(*common, "--iterations", "30", "--out", str(tmp_path / "run")) == 0
    cmd = TORCHRUN + ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                      "-m", "shmtrain", "train", *common[2:],  # torchrun gives the workers
                      "--iterations", "60", "--out", str(tmp_path / "run")]
    result = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resuming" in result.stdout and "step-30" in result.stdout, result.stdout
    assert_same_weights(weights(tmp_path / "run" / "model.pt"), weights(tmp_path / "straight" / "model.pt"))


def test_bench_checkpoint_rows(tmp_path: Path) -> None:
    out = tmp_path / "ckpt.json"
    result = subprocess.run(
        [sys.executable, "-m", "shmtrain", "bench", "checkpoint", "--model", "mlp", "--input-shape", "1x8x8",
         "--workers", "1", "--iterations", "2", "--warmup", "1", "--reps", "2", "--dir", str(tmp_path),
         "--json", str(out)],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, SHMTRAIN_NO_PROGRESS="1"))
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(out.read_text())
    assert row["model"] == "mlp" and row["mb_per_rank"] > 0
    assert all(row[k] > 0 for k in ("iteration_s", "snapshot_s", "save_s", "load_s", "validate_s"))
    assert "ckpt/iter" in result.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.json"]  # its checkpoints removed
