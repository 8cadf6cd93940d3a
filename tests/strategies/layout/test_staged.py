"""The GPU data flow of every strategy, run on the CPU.

With ``SHMTRAIN_STAGING=copy`` a strategy on CPU parameters takes the path it takes on a
GPU: the parameters and gradients stay in private tensors and every transfer to and
from the host buffers is a real copy through :class:`shmtrain.strategies.layout.staging.HostStaging`
(on a GPU the same calls run on copy streams; ``tests/gpu/test_cuda.py`` runs them there).
Checked here: the synchronous strategies still equal single-process SGD, the others give
bit for bit the weights they give unstaged, and no parameter or gradient is left in
shared memory.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from shmtrain.runtime.launch.launcher import launch
from shmtrain.strategies.layout.flat import FlatLayout
from shmtrain.strategies.layout.staging import STAGING_ENV, HostStaging, force_copies, staged

pytestmark = pytest.mark.timeout(180)

STEPS, BATCH = 30, 6


def test_copy_mode_is_chosen_by_the_environment_and_checked() -> None:
    assert staged("cpu") is False
    with force_copies():
        assert staged("cpu") is True
        params = list(nn.Linear(3, 2).parameters())
        staging = HostStaging(FlatLayout(params), "cpu")
        assert staging.copies and staging.mode == "copy"
        grad = torch.randn(2, 3)
        host, copy = staging.to_host(0, grad)
        assert host is not grad and torch.equal(host, grad) and copy.done() and copy.wait() >= 0
        src = torch.randn(2)
        staging.to_device(1, params[1], src)
        assert params[1].grad is not src and torch.equal(params[1].grad, src)
        staging.to_device(1, params[1], src, data=True)
        assert params[1].data_ptr() != src.data_ptr() and torch.equal(params[1].data, src)
        assert [i for i, _ in staging.device_times()] == [1, 1]
    assert staged("cpu") is False
    os.environ[STAGING_ENV] = "yes"
    try:
        with pytest.raises(ValueError, match=r"SHMTRAIN_STAGING='yes': the only value is copy"):
            staged("cpu")
    finally:
        del os.environ[STAGING_ENV]


# Deterministic runs of the strategies that do not equal plain SGD (one updater of the
# global weights, or a synchronous average): staged and unstaged must agree.
CASES = {"easgd": 1, "downpour": 1, "seasgd": 1, "hsgd": 2, "ps_weight": 2, "ssgd_bf16": 2}


@pytest.mark.parametrize("case", sorted(CASES))
def test_staged_equals_unstaged(case: str) -> None:
    workers = CASES[case]
    runs = {copies: launch("support.equivalence:equivalence_worker", workers,
                           {"mode": case, "steps": 12, "batch": BATCH, "staged": copies}, timeout=150)
            for copies in (False, True)}
    for rank in range(workers):  # the same arithmetic on copies: the same bits
        assert runs[True][rank]["digests"] == runs[False][rank]["digests"], f"{case}: rank {rank} staged differs"
        assert runs[True][rank]["staged"] and runs[True][rank]["shared"] == 0, f"{case}: rank {rank} in shared memory"


# the synchronous strategies (and each kind of transport): one worker count each
SYNC = [("ssgd", 2), ("ssgd_ring", 3), ("ssgd_overlap", 3), ("gpi", 4), ("cpu_acc", 2), ("ps_grad", 3)]


@pytest.mark.parametrize("mode,workers", SYNC)
def test_staged_synchronous_strategies_equal_single_process_sgd(mode: str, workers: int) -> None:
    results = launch("support.equivalence:equivalence_worker", workers,
                     {"mode": mode, "steps": STEPS, "batch": BATCH, "staged": True}, timeout=150)
    assert all(r["staged"] for r in results)
    for step, errors in enumerate(results[0]["errors"], start=1):
        name, worst = max(errors.items(), key=lambda item: item[1])
        assert worst < 1e-5, f"staged {mode}, step {step}: relative error {worst:.2e} ({name})"
    for rank, result in enumerate(results[1:], start=1):
        assert result["digests"] == results[0]["digests"], f"staged {mode}: rank {rank} holds other weights"
        assert result["shared"] == 0
    phases = results[0]["last"]["time"]
    if mode != "cpu_acc":  # cpu_acc reports its copies per layer (TRL Table 4), below
        assert {"copy_to_host", "copy_to_device"} <= set(phases), phases
    else:
        assert all(layer["copy_s"] >= 0 and layer["copy_back_s"] >= 0 for layer in results[0]["last"]["layers"])


def test_the_shared_memory_check_sees_the_zero_copy_path() -> None:
    """Unstaged, ssgd's gradients are views of the allreduce's slots: the check above
    would see them (it is not vacuous)."""
    results = launch("support.equivalence:equivalence_worker", 2, {"mode": "ssgd", "steps": 2, "batch": BATCH},
                     timeout=90)
    assert results[0]["staged"] is False and results[0]["shared"] > 0
