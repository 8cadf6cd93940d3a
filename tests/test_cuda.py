"""The CUDA path of ``cpu_acc`` (TRL Algorithm 6 on a GPU: D2H copies on their own
stream into pinned memory, H2D copies of the finished sums on another stream), all
through :class:`shmtrain.fabric.staging.HostStaging` (its own round trip:
``tests/test_staging.py``).

Runs only where a GPU is present (no CPU test depends on it); on a GPU host two workers
share device 0, which exercises the same streams, events and pinned/registered host
buffers as one GPU per worker.
"""

from __future__ import annotations

import pytest
import torch

from shmtrain.runtime.launcher import launch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("workers", [2, 3])
def test_cpu_acc_on_cuda_matches_single_process_sgd(workers: int) -> None:
    results = launch("test_overlap:equivalence_worker", workers,
                     {"mode": "cpu_acc", "steps": 50, "batch": 6, "device": "cuda"},
                     timeout=170)
    assert len(results[0]["errors"]) == 50
    for step, errors in enumerate(results[0]["errors"], start=1):
        name, worst = max(errors.items(), key=lambda item: item[1])
        assert worst < 1e-5, f"cuda cpu_acc, step {step}: relative error {worst:.2e} ({name})"
    for rank, result in enumerate(results[1:], start=1):
        assert result["digests"] == results[0]["digests"], f"rank {rank} holds other weights"
    last = results[0]["last"]
    assert last["time"]["collect_remaining"] >= 0
    # on a GPU the hand-off and copy-back are real copies, timed with CUDA events
    assert any(layer["copy_s"] > 0 for layer in last["layers"])
    assert any(layer["copy_back_s"] > 0 for layer in last["layers"])
