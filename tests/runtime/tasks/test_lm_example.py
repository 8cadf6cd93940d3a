"""The language-model example (``examples/lm_text.py``: a byte-level transformer on the
standard library's source files, held out by file) under ``shmtrain train --task
language-model`` with ssgd and 2 workers ends with the weights and the held-out perplexity
of a plain single-process PyTorch loop with the same hyper-parameters and seed.

Tolerance: ssgd averages the two workers' gradients in float32 (each the mean over its
half of the batch, summed in another order than the plain loop's mean over the whole
batch), so every step differs from the plain loop's by float32 round-off (~1e-7 relative);
AdamW's normalisation carries that into the weights (it divides each gradient by its own
running scale, so a near-zero component's difference counts fully), and the perplexity,
an average over every held-out byte, agrees far closer. Measured on this 2-core VM
(2026-11-27): 100 steps of the example's own model, weights 2.2e-5 apart (bound 1e-4),
perplexity 10.765258 against 10.765257 (1.0e-7; bound 1e-5); the dozen steps of the
default-suite version, weights 7.0e-6 apart (bound 5e-5), perplexity equal to every digit
(bound 1e-5)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch.utils.data import default_collate

from shmtrain.cli import main
from shmtrain.runtime.data.tensors import ShardSampler
from shmtrain.runtime.tasks import build_task
from support.paths import ROOT
from support.reference import relative_error

SEED, LR, WORKERS = 0, 3e-3, 2


def plain_loop(data_args: dict, model_args: dict, steps: int, batch: int) -> tuple[torch.Tensor, float]:
    """AdamW (lr, weight decay 1e-4: shmtrain's default) over the union of the workers'
    batches of every step, in the shard sampler's order; (flat weights, held-out perplexity)."""

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a worker computes (--threads 1): no oversubscribed cores
    try:
        return _plain_loop(data_args, model_args, steps, batch)
    finally:
        torch.set_num_threads(threads)


def _plain_loop(data_args: dict, model_args: dict, steps: int, batch: int) -> tuple[torch.Tensor, float]:
    from examples.lm_text import Net, stdlib_text

    torch.manual_seed(SEED)
    train, val = stdlib_text(**data_args)
    model = Net(**model_args)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=1e-4)
    task = build_task("language-model")
    samplers = [ShardSampler(len(train), batch, WORKERS, rank, SEED) for rank in range(WORKERS)]
    for step in range(steps):
        tokens = default_collate([train[i] for i in torch.cat([s.indices(step) for s in samplers]).tolist()])
        opt.zero_grad()
        task.loss(model, tokens).backward()
        opt.step()
    held_out = torch.utils.data.DataLoader(val, batch_size=256)
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return weights, task.evaluate(model, held_out)["perplexity"]


def shmtrain_run(out: Path, data_args: str, model_args: str, steps: int, batch: int) -> tuple[torch.Tensor, float]:
    assert main(["train", "--task", "language-model", "--data", "examples.lm_text:stdlib_text", "--data-args",
                 data_args, "--model", "examples.lm_text:Net", "--model-args", model_args, "--optimizer", "adamw",
                 "--lr", str(LR), "--batch-size", str(batch), "--workers", str(WORKERS), "--iterations", str(steps),
                 "--loader-workers", "0", "--eval-every", "0", "--seed", str(SEED), "--out", str(out),
                 "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "language-model" and summary["metric"] == "perplexity"
    state = torch.load(out / "model.pt")
    return torch.cat([v.reshape(-1) for k, v in state.items()]), summary["perplexity"]


@pytest.fixture
def at_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # examples importable, as the docs run it
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


@pytest.mark.timeout(170)
def test_the_lm_example_equals_a_plain_loop(tmp_path: Path, at_root: None) -> None:
    steps, batch = 12, 8
    weights, perplexity = shmtrain_run(tmp_path / "lm", "files=12; length=32", "width=32; layers=1; heads=2",
                                       steps, batch)
    ref_weights, ref_perplexity = plain_loop({"files": 12, "length": 32}, {"width": 32, "layers": 1, "heads": 2},
                                             steps, batch)
    print(f"weights rel {relative_error(weights, ref_weights):.3g}, perplexity {perplexity!r} vs {ref_perplexity!r}")
    assert relative_error(weights, ref_weights) < 5e-5
    assert perplexity == pytest.approx(ref_perplexity, rel=1e-5)
    assert perplexity < 200  # it learned something in 12 steps (256: knows nothing)
    # shmtrain evaluate on the run: the task's metric of its model.pt, as the run reported it
    from shmtrain.runtime.evaluate import evaluate

    result = evaluate(str(tmp_path / "lm"), {})
    assert result["task"] == "language-model" and result["metric"] == "perplexity"
    assert result["perplexity"] == pytest.approx(perplexity, rel=1e-6)


@pytest.mark.slow  # the example's own model, 60 files (minutes on 2 cores)
@pytest.mark.timeout(900)
def test_the_lm_example_at_its_own_size_equals_a_plain_loop(tmp_path: Path, at_root: None) -> None:
    steps, batch = 100, 16
    weights, perplexity = shmtrain_run(tmp_path / "lm", "files=60", "", steps, batch)
    ref_weights, ref_perplexity = plain_loop({"files": 60}, {}, steps, batch)
    print(f"weights rel {relative_error(weights, ref_weights):.3g}, perplexity {perplexity!r} vs {ref_perplexity!r}")
    # 100 AdamW steps: the per-step round-off grows in the weights (AdamW divides each
    # gradient by its own running scale, so near-zero components' differences count fully):
    # measured 2.2e-5; the perplexity, an average over every held-out byte, 1.0e-7
    assert relative_error(weights, ref_weights) < 1e-4
    assert perplexity == pytest.approx(ref_perplexity, rel=1e-5)
    assert perplexity < 20


@pytest.mark.slow  # two torchrun hosts of 2 workers each (~30 s on 2 cores)
@pytest.mark.timeout(300)
def test_the_lm_example_trains_with_the_hybrid_across_two_hosts(tmp_path: Path, at_root: None) -> None:
    import subprocess
    import sys

    from support.torchrun import env, free_port

    port, out = str(free_port()), tmp_path / "lm-hybrid"
    args = ["train", "--task", "language-model", "--data", "examples.lm_text:stdlib_text", "--data-args",
            "files=12; length=32", "--model", "examples.lm_text:Net", "--model-args", "width=32; layers=1; heads=2",
            "--optimizer", "adamw", "--lr", str(LR), "--batch-size", "8", "--iterations", "12", "--strategy", "diloco",
            "--inner", "host-sync", "--sync-every", "4", "--loader-workers", "0", "--seed", str(SEED),
            "--out", str(out), "--no-progress"]
    hosts = [subprocess.Popen([sys.executable, "-m", "shmtrain", "torchrun", "--nnodes", "2", "--node-rank", str(r),
                               "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", port, *args],
                              env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in (0, 1)]
    outputs = [h.communicate(timeout=240)[0].decode() for h in hosts]
    assert [h.returncode for h in hosts] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "language-model" and summary["workers"] == 4 and summary["iterations"] == 12
    assert summary["perplexity"] < 200  # it learned (256: knows nothing)

