"""Runs of ``shmtrain train`` and what they leave: the small jobs the run tests share,
runs started in this process or in their own process group, their weights and metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from shmtrain.cli import main

#: a small job: exactness does not depend on the model, and a worker launch costs ~3-5 s
SMALL = ["--workers", "2", "--model", "mlp", "--data", "synthetic", "--samples", "256",
         "--input-shape", "1x8x8", "--batch-size", "8", "--no-progress"]
#: long enough to be interrupted mid-run (about 1 ms per iteration here)
LONG = [*SMALL, "--iterations", "3000", "--checkpoint-every", "100", "--timeout", "60"]


def train(*args: str) -> int:
    """``shmtrain train ARGS`` in this process (workers forked from its zygote): the exit status."""
    return main(["train", *args])


def weights(path: Path) -> dict[str, torch.Tensor]:
    """model.pt, or rank 0's model state in a checkpoint folder."""
    if path.is_dir():
        return torch.load(path / "rank-0.pt", weights_only=False)["model"]
    return torch.load(path)


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """The same tensors under the same names, to a relative error of 1e-6 each."""
    assert a.keys() == b.keys()
    for key in a:
        assert float((a[key] - b[key]).norm() / b[key].norm().clamp_min(1e-12)) < 1e-6, key


def iterations_logged(run: Path, rank: int) -> list[int]:
    """The iterations of a rank's training rows in a run folder's metrics, in file order."""
    rows = [json.loads(r) for r in (run / "metrics" / f"rank-{rank}.jsonl").read_text().splitlines()]
    return [r["iteration"] for r in rows if "eval" not in r]


def start(args: list[str]) -> subprocess.Popen:
    """``shmtrain train`` in its own process group (as a terminal would run it)."""
    return subprocess.Popen([sys.executable, "-m", "shmtrain", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, SHMTRAIN_NO_PROGRESS="1"))


def wait_for(condition, launcher: subprocess.Popen, what: str, timeout: float = 90) -> None:
    """Poll ``condition()`` until it holds; fail naming ``what`` (with the launcher's
    output) if the launcher ends first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        assert launcher.poll() is None, (what, launcher.communicate())
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


def rows_written(run: Path, rank: int) -> int:
    """The lines of a rank's metrics file so far (0 before it exists)."""
    file = run / "metrics" / f"rank-{rank}.jsonl"
    return file.read_text().count("\n") if file.exists() else 0
