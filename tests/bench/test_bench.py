"""Benchmarks run end to end on tiny sizes and write the documented JSON rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shmtrain.bench.common import parse_size


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shmtrain", "bench", *args], capture_output=True, text=True,
                          timeout=170, env=dict(os.environ, SHMTRAIN_NO_PROGRESS="1"))


def test_bench_allreduce_rows(tmp_path: Path) -> None:
    out = tmp_path / "ar.json"
    result = run("allreduce", "--procs", "2", "--sizes", "1MiB", "4MiB", "--reps", "3", "--peers", "gloo",
                 "--json", str(out))
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())
    assert {(r["impl"], r["procs"], r["bytes"]) for r in rows} == {
        (impl, 2, size) for impl in ("shm", "shm-private", "gloo") for size in (1 << 20, 4 << 20)
    }
    assert all(r["median_s"] > 0 and r["correct"] for r in rows)
    assert "private/best" in result.stdout


@pytest.mark.slow
def test_bench_step_rows(tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    result = run("step", "--model", "smallcnn", "--input-shape", "1x8x8", "--workers", "1", "2",
                 "--iterations", "3", "--warmup", "1", "--json", str(out))
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())
    assert {(r["mode"], r["workers"]) for r in rows} == {(m, w) for m in ("nocomm", "ddp", "ssgd") for w in (1, 2)}
    assert all(r["model"] == "smallcnn" and r["median_s"] > 0 for r in rows)


def test_bad_bench_input_is_named(capsys: pytest.CaptureFixture) -> None:
    """In this process (the command line's own main): each is refused before anything starts."""
    from shmtrain.cli import main

    def refused(*args: str) -> str:
        try:
            code = main(["bench", *args])
        except SystemExit as exc:  # argparse's own refusals
            code = exc.code
        assert code == 2, args
        return capsys.readouterr().err

    assert "0MiB" in refused("allreduce", "--sizes", "0MiB")
    assert "warp" in refused("step", "--modes", "warp")
    assert "at most 9 per run" in refused("allreduce", "--sizes", *(f"{k}KiB" for k in range(1, 12)))


@pytest.mark.parametrize("text,value", [("64MiB", 64 << 20), ("1MB", 10**6), ("4096", 4096), ("97.7MB", 97_700_000)])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


def test_bench_device_picks_the_modes_of_the_device() -> None:
    from shmtrain.bench.common import bench_device

    if torch.cuda.is_available():
        assert bench_device("cuda", ["ddp"], ["ssgd"], None) == ("cuda", ["ssgd"])
        with pytest.raises(ValueError, match=r"--modes ddp with --device cuda: DDP on GPUs needs NCCL"):
            bench_device("cuda", ["ddp"], ["ssgd"], ["nocomm", "ddp"])
    else:
        assert bench_device("auto", ["nocomm", "ddp"], ["ssgd"], None) == ("cpu", ["nocomm", "ddp"])
        with pytest.raises(ValueError, match=r"--device 'cuda': this machine has no CUDA device"):
            bench_device("cuda", ["ddp"], ["ssgd"], None)
    assert bench_device("cpu", ["nocomm"], ["ssgd"], ["gpi"]) == ("cpu", ["gpi"])
