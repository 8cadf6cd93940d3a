"""Lightning's own DDPStrategy on the ``shm`` backend: with ``self.log(..., sync_dist=True)``
(whose counters Lightning averages as integers) it trains and logs bit for bit as on gloo,
and so does ShmtrainStrategy with ``process_group_backend="shm"``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning", reason="Lightning is not installed (pip install -e '.[test]')")

from support.lightning_runs import lightning_command, run, seen, weights  # noqa: E402


def test_ddp_on_shm_with_sync_dist_logging_equals_gloo_bit_for_bit(tmp_path: Path) -> None:
    runs = {"gloo": ("ddp", "gloo"), "shm": ("ddp", "shm"), "shmtrain": ("shmtrain", "shm")}
    outs = {name: tmp_path / f"{name}.pt" for name in runs}
    run({name: lightning_command(outs[name], strategy=strategy, backend=backend, sync_dist=True)
         for name, (strategy, backend) in runs.items()})
    gloo = seen(outs["gloo"])["metrics"]
    assert set(gloo) >= {"train_loss", "seen"} and gloo["seen"] == 128.0  # every sample of the epoch, summed
    for name in ("shm", "shmtrain"):
        assert torch.equal(weights(outs[name]), weights(outs["gloo"])), name
        assert seen(outs[name])["metrics"] == gloo, name
