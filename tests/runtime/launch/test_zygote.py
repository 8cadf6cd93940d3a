"""Fast worker start (``runtime/launch/zygote.py``): workers are forked by one zygote that
imported torch once, stays for the launching process's life, and trains exactly as
workers started fresh (``SHMTRAIN_ZYGOTE=0``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import torch

from shmtrain.cli import main
from shmtrain.runtime.launch import zygote
from shmtrain.runtime.launch.launcher import launch

RUN = ["--model", "mlp", "--workers", "2", "--iterations", "6", "--no-progress", "--checkpoint-every", "0"]


def names(ctx, payload):  # noqa: ARG001 - a launch target
    return {"comm": Path("/proc/self/comm").read_text().strip(), "ppid": os.getppid(), "rank": ctx.rank}


def test_one_zygote_forks_every_worker_of_every_launch() -> None:
    first = launch("runtime.launch.test_zygote:names", 2)
    keeper = zygote.pid()
    second = launch("runtime.launch.test_zygote:names", 3)
    assert keeper is not None and zygote.pid() == keeper  # one zygote, kept between launches
    for results in (first, second):
        for result in results:
            assert result["comm"] == f"shmtrain-w{result['rank']}" and result["ppid"] == keeper
    assert "shmtrain.runtime.launch.zygote" in " ".join(psutil.Process(keeper).cmdline())


def test_forked_workers_train_exactly_as_fresh_ones(tmp_path: Path) -> None:
    assert main(["train", *RUN, "--out", str(tmp_path / "forked")]) == 0
    fresh = subprocess.run([sys.executable, "-m", "shmtrain", "train", *RUN, "--out", str(tmp_path / "fresh")],
                           env=dict(os.environ, SHMTRAIN_ZYGOTE="0"), capture_output=True, text=True, timeout=120)
    assert fresh.returncode == 0, fresh.stderr
    a, b = torch.load(tmp_path / "forked" / "model.pt"), torch.load(tmp_path / "fresh" / "model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def preloaded_worker(ctx, payload) -> list[bool]:
    return [name in sys.modules for name in payload]


def test_a_worker_environment_can_ask_the_zygote_to_preload() -> None:
    # what ``shmtrain train --model resnet18`` asks for: torchvision imported once, in the zygote
    seen = launch("runtime.launch.test_zygote:preloaded_worker", 1, ["torchvision", "torch._dynamo"],
                  env={zygote.PRELOAD_ENV: "torchvision, no_such_module_xyz"})
    assert seen == [[True, True]]


def test_digits_read_from_the_packaged_table_equal_scikit_learns() -> None:
    from sklearn.datasets import load_digits

    from shmtrain.runtime.data.tensors import _digits_table, load_digits_data

    table, digits = _digits_table(), load_digits()
    assert (table[:, :64] == digits.data).all() and (table[:, 64] == digits.target).all()
    data = load_digits_data()
    assert data.train_x.shape[1:] == (1, 8, 8) and len(data.train_x) + len(data.test_x) == 1797
    assert float(data.train_x.max()) == 1.0 and load_digits_data() is data  # read once per process
