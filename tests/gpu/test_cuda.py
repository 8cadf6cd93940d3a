"""GPU workers: every strategy on CUDA parameters, its buffers in host memory.

Runs only where a GPU is present (no CPU test depends on it; the same data flow runs on
the CPU in ``tests/strategies/layout/test_staged.py``). On a host with one GPU the workers share device 0
(``--device cuda:0``), which exercises the same copy streams, events and pinned or
registered host buffers as one GPU per worker; NCCL, which cannot share a GPU, runs
with one worker per GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shmtrain import strategies
from shmtrain.runtime.launch.launcher import WorkerFailed, launch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(600)]


def _check_equivalence(results: list[dict], label: str, steps: int) -> None:
    assert len(results[0]["errors"]) == steps
    for step, errors in enumerate(results[0]["errors"], start=1):
        name, worst = max(errors.items(), key=lambda item: item[1])
        assert worst < 1e-5, f"cuda {label}, step {step}: relative error {worst:.2e} ({name})"
    for rank, result in enumerate(results[1:], start=1):
        assert result["digests"] == results[0]["digests"], f"cuda {label}: rank {rank} holds other weights"


@pytest.mark.parametrize("workers", [2, 3])
def test_cpu_acc_on_cuda_matches_single_process_sgd(workers: int) -> None:
    results = launch("support.equivalence:equivalence_worker", workers,
                     {"mode": "cpu_acc", "steps": 50, "batch": 6, "device": "cuda"}, timeout=170)
    _check_equivalence(results, "cpu_acc", 50)
    last = results[0]["last"]
    assert last["time"]["collect_remaining"] >= 0
    # on a GPU the hand-off and copy-back are real copies, timed with CUDA events
    assert any(layer["copy_s"] > 0 for layer in last["layers"])
    assert any(layer["copy_back_s"] > 0 for layer in last["layers"])


@pytest.mark.parametrize("mode", ["ssgd", "ssgd_overlap", "gpi", "ps_grad"])
def test_synchronous_strategies_on_cuda_match_single_process_sgd(mode: str) -> None:
    results = launch("support.equivalence:equivalence_worker", 2,
                     {"mode": mode, "steps": 30, "batch": 6, "device": "cuda"}, timeout=170)
    _check_equivalence(results, mode, 30)
    assert results[0]["staged"] and results[0]["shared"] == 0
    phases = results[0]["last"]["time"]
    assert phases["copy_to_host"] > 0 and phases["copy_to_device"] > 0  # CUDA events on the copy streams


def _train(out: Path, *args: str) -> dict:
    subprocess.run([sys.executable, "-m", "shmtrain", "train", "--workers", "2", "--epochs", "6",
                    "--no-progress", "--out", str(out), *args], check=True, capture_output=True, timeout=280)
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("name", sorted(set(strategies.registry()) - {"single"}))
def test_every_strategy_trains_on_cuda_as_on_the_cpu(name: str, tmp_path: Path) -> None:
    cpu = _train(tmp_path / "cpu", "--strategy", name, "--device", "cpu")
    gpu = _train(tmp_path / "cuda", "--strategy", name, "--device", "cuda:0")
    assert set(gpu["devices"].values()) == {"cuda:0"} and set(cpu["devices"].values()) == {"cpu"}
    assert gpu["accuracy"] >= cpu["accuracy"] - 0.03, (name, cpu["accuracy"], gpu["accuracy"])
    assert "copy_to_host" in gpu["phases_ms"] or name in ("nocomm", "easgd", "downpour", "seasgd", "cpu_acc")


def test_bf16_on_cuda_is_not_worse_than_float32_by_more_than_one_point(tmp_path: Path) -> None:
    """One-sided: bf16 may do better (on an H100 it reached 0.9916 against float32's 0.9777)."""
    plain = _train(tmp_path / "none", "--device", "cuda:0", "--epochs", "10")
    bf16 = _train(tmp_path / "bf16", "--device", "cuda:0", "--epochs", "10", "--amp", "bf16")
    assert plain["accuracy"] > 0.9 and bf16["accuracy"] >= plain["accuracy"] - 0.01, (plain, bf16)


def test_fp16_on_cuda_trains(tmp_path: Path) -> None:
    plain = _train(tmp_path / "none", "--device", "cuda:0", "--epochs", "10")
    fp16 = _train(tmp_path / "fp16", "--device", "cuda:0", "--epochs", "10", "--amp", "fp16")
    assert abs(fp16["accuracy"] - plain["accuracy"]) <= 0.02, (plain["accuracy"], fp16["accuracy"])


def test_nccl_refuses_workers_that_share_a_gpu() -> None:
    with pytest.raises(WorkerFailed, match=r"--allreduce nccl needs one GPU per worker, but ranks 0, 1 share"):
        launch("support.equivalence:equivalence_worker", 2,
               {"mode": "ssgd_nccl", "steps": 2, "batch": 6, "device": "cuda:0"}, timeout=120)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per worker: 2 GPUs")
def test_nccl_matches_single_process_sgd() -> None:
    results = launch("support.equivalence:equivalence_worker", 2,
                     {"mode": "ssgd_nccl", "steps": 30, "batch": 6, "device": "cuda"}, timeout=170)
    _check_equivalence(results, "nccl", 30)


def test_nccl_with_one_worker_trains(tmp_path: Path) -> None:
    summary = _train(tmp_path / "nccl", "--workers", "1", "--allreduce", "nccl", "--device", "cuda")
    assert summary["accuracy"] > 0.8 and "comm" in summary["phases_ms"]


def test_a_gpu_index_beyond_the_count_is_refused(tmp_path: Path) -> None:
    count = torch.cuda.device_count()
    proc = subprocess.run([sys.executable, "-m", "shmtrain", "train", "--device", f"cuda:{count}",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"--device 'cuda:{count}': there are {count} CUDA device(s) here" in proc.stderr
