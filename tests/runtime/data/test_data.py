"""Any data, from the command line and TOML: ``--data module:callable``
(a Dataset or a (train, val) pair), image folders decoded lazily by DataLoader processes,
exact shards and mid-epoch resume through the batch sampler, the class map and the data's
facts in the run folder, the loader processes gone on every exit path, and every refusal."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from conftest import worker_process
from shmtrain.cli import main
from shmtrain.runtime.data.loader import LoaderBatches
from shmtrain.runtime.data.sources import DataSource
from shmtrain.runtime.data.tensors import ShardSampler
from support.data_sets import Indexed
from support.paths import ROOT
from support.runs import rows_written, start, wait_for

sys.path.insert(0, str(ROOT))  # examples/ importable, as from the repository's root
from examples.make_image_folder import make  # noqa: E402

TINY = ["--workers", "2", "--batch-size", "8", "--no-progress", "--timeout", "60"]


def _indexed(size: int = 40) -> DataSource:
    return DataSource("indexed", Indexed(size), Indexed(8), 4, (2,), {str(i): i for i in range(4)})


def _take(world: int, rank: int, workers: int, steps: range, batch: int) -> list[torch.Tensor]:
    source = _indexed()
    batches = LoaderBatches(source, ShardSampler(len(source.train), batch, world, rank, seed=3), workers,
                            pin=False, prefetch=4, seed=3, start=steps.start)
    try:
        return [batches.next()[0] for _ in steps]
    finally:
        batches.close()


# -- sharding through DataLoader processes ------------------------------------------------------
def test_the_shards_of_loader_processes_are_exact_and_resume_mid_epoch() -> None:
    steps = range(10)  # two epochs of 40 samples, 8 per global step
    single = _take(1, 0, 0, steps, 8)  # one process, batch 8, no loader process
    ranks = [_take(2, rank, 2, steps, 4) for rank in range(2)]  # two workers of batch 4, 2 processes each
    for step in steps:
        union = torch.cat([ranks[0][step], ranks[1][step]])
        assert torch.equal(union, single[step]), step  # indices and the random draw of every item
    for epoch in range(2):
        seen = torch.cat(single[epoch * 5 : epoch * 5 + 5])[:, 0]
        assert sorted(seen.tolist()) == list(range(40))  # every sample once per epoch
    assert not torch.equal(single[0][:, 0], single[5][:, 0])  # a new permutation per epoch
    assert not torch.equal(single[0][:, 1], _take(1, 0, 0, range(5, 6), 8)[0][:, 1])
    resumed = _take(2, 1, 2, range(7, 10), 4)  # mid-epoch 1, from the step number alone
    for got, want in zip(resumed, ranks[1][7:], strict=True):
        assert torch.equal(got, want)


def test_fetching_in_the_training_process_leaves_its_rng_alone() -> None:
    torch.manual_seed(5)
    before = torch.get_rng_state()
    _take(1, 0, 0, range(3), 8)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_label_outside_the_declared_classes_is_named() -> None:
    source = DataSource("indexed", Indexed(40), Indexed(8), 2, (2,), {"0": 0, "1": 1})  # labels go to 3
    batches = LoaderBatches(source, ShardSampler(40, 8, 1, 0, 0), 0, False, 2, 0)
    with pytest.raises(ValueError, match=r"label 3 is outside 0\.\.1"):
        batches.next()
    batches.close()


# -- --data module:callable ---------------------------------------------------------------------
@pytest.mark.parametrize(("spec", "args", "classes", "counts"), [
    ("support.data_sets:blobs", [], {"0": 0, "1": 1, "2": 2}, "77 training samples, 19 held out"),
    ("support.data_sets:named_pair", ["--data-args", "samples=60"], {"low": 0, "mid": 1, "high": 2},
     "60 training samples, 24 held out"),
])
def test_a_callable_data_set_trains(spec: str, args: list[str], classes: dict, counts: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    code = main(["train", "--data", spec, *args, "--model", "mlp", *TINY, "--loader-workers", "1",
                 "--iterations", "30", "--lr", "0.1", "--out", str(run)])
    assert code == 0
    assert json.loads((run / "classes.json").read_text()) == classes
    toml = (run / "config.toml").read_text()
    assert f'data = "{spec}"' in toml and "inputs 1x4x4, 3 classes" in toml and counts in toml, toml
    assert json.loads((run / "summary.json").read_text())["accuracy"] > 0.6


@pytest.mark.parametrize(("flags", "words"), [
    (["--data", "nowhere_module:f"], ["--data 'nowhere_module:f'", "cannot import", "PYTHONPATH"]),
    (["--data", "support.data_sets:nothing"], ["has no nothing"]),
    (["--data", "support.data_sets:not_a_dataset"], ["returned a int", "not a torch.utils.data.Dataset"]),
    (["--data", "support.data_sets:no_pairs"], ["not an (x, label) pair", "(tensor, int)"]),
    (["--data", "support.data_sets:int_inputs"], ["torch.int64 tensor", "floating-point"]),
    (["--data", "support.data_sets:float_labels"], ["0.5", "not an integer class index"]),
    (["--data", "support.data_sets:stream"], ["IterableDataset", "map-style"]),
    (["--data", "support.data_sets:blobs", "--data-args", "colour=1"], ["--data-args 'colour=1'", "colour"]),
    (["--data", "support.data_sets:blobs", "--data-args", "samples"], ["is not k=v"]),
    (["--data", "support.data_sets:blobs", "--data-args", "samples=1"], ["1 item(s)", "at least 2"]),
    (["--data", "support.data_sets:named_pair", "--val-fraction", "0.1"], ["--val-fraction 0.1", "(train, val) pair"]),
    (["--data", "support.data_sets:blobs", "--transform", "standard"], ["--transform 'standard'", "a folder --data"]),
    (["--data", "digits", "--loader-workers", "2"], ["--loader-workers 2", "would be ignored"]),
    (["--data", "digits", "--data-args", "a=1"], ["--data-args", "module:callable"]),
    (["--data", "digits", "--input-shape", "3x8x8"], ["--input-shape '3x8x8'", "1x8x8"]),
    (["--data", "synthetic", "--image-size", "8"], ["--image-size 8", "a folder --data"]),
    (["--data", "digits", "--val-data", "{tmp}"], ["--val-data", "a folder --data"]),
    (["--data", "{shapes}/train", "--samples", "50"], ["--samples 50", "--data synthetic"]),
    (["--data", "{shapes}/train", "--image-size", "16", "--input-shape", "3x8x8"], ["disagree", "--image-size 8"]),
    (["--data", "{shapes}/train", "--input-shape", "1x16x16"], ["RGB", "3x16x16"]),
    (["--data", "{shapes}/train", "--val-data", "{shapes}/val", "--val-fraction", "0.3"], ["drop one"]),
    (["--data", "{shapes}/train", "--val-data", "{tmp}"], ["--val-data", "class folders", "same class"]),
    (["--data", "{shapes}/train", "--val-data", "{tmp}/nowhere"], ["--val-data", "no such folder"]),
    (["--data", "{shapes}/train", "--val-fraction", "1.5"], ["--val-fraction 1.5", "(0, 1)"]),
    (["--data", "{shapes}/train", "--loader-workers", "-1"], ["--loader-workers -1", "negative"]),
    (["--data", "{shapes}/train", "--transform", "fancy"], ["--transform", "fancy"]),
])
def test_bad_data_options_are_refused_before_any_worker(flags: list[str], words: list[str], tmp_path: Path,
                                                         capsys) -> None:
    make(tmp_path / "shapes", classes=3, per_class=4, size=8)
    make(tmp_path / "two", classes=2, per_class=4, size=8)
    flags = [f.format(tmp=tmp_path / "two" / "val", shapes=tmp_path / "shapes") for f in flags]
    try:
        code = main(["train", *flags, "--model", "mlp", *TINY, "--iterations", "2", "--out", str(tmp_path / "run")])
    except SystemExit as exc:  # argparse: a choice that does not exist
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    for word in words:
        assert word in err, err
    assert not (tmp_path / "run").exists()


def test_too_many_items_without_classes_are_refused_with_the_fix(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr("shmtrain.runtime.data.user_data.SCAN_LIMIT", 50)
    assert main(["train", "--data", "support.data_sets:blobs", "--model", "mlp", *TINY,
                 "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "number of classes is not known" in err and "dataset.num_classes = N" in err, err


def test_a_label_beyond_the_declared_classes_fails_the_run_by_name(tmp_path: Path, capsys) -> None:
    code = main(["train", "--data", "support.data_sets:wrong_classes", "--model", "mlp", *TINY, "--iterations", "3",
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 1 and "is outside 0..1" in err and "Traceback" not in err, err


# -- an image folder, from the command line ---------------------------------------------------------
FOLDER_RUN = ["--model", "examples.mynet:Net", "--model-args", "width=8", "--image-size", "16",
              "--transform", "standard", "--optimizer", "adamw", "--lr", "3e-3", "--grad-clip", "1.0",
              "--accumulate", "2", "--strategy", "ssgd", "--checkpoint-every", "0", *TINY]


def _folder_args(data: Path, out: Path, iterations: int) -> list[str]:
    return ["--data", str(data / "train"), "--val-data", str(data / "val"), *FOLDER_RUN,
            "--iterations", str(iterations), "--out", str(out)]


# Ctrl-C resume by default in runtime/checkpoint/test_checkpoint.py, folders in cli/test_cli.py
@pytest.mark.slow  # ~60 s of CPU
@pytest.mark.timeout(240)
def test_an_image_folder_trains_and_resumes_after_ctrl_c_to_the_same_weights(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)  # examples.mynet importable, as the docs run it
    make(tmp_path / "shapes", classes=3, per_class=20, size=16)
    total = 300
    straight = tmp_path / "straight"
    assert main(["train", *_folder_args(tmp_path / "shapes", straight, total)]) == 0
    assert json.loads((straight / "classes.json").read_text()) == {"disc": 0, "hbar": 1, "square": 2}
    toml = (straight / "config.toml").read_text()
    assert 'input-shape = "3x16x16"' in toml and "image-size" not in toml and "samples =" not in toml, toml
    assert "inputs 3x16x16, 3 classes" in toml and "60 training samples, 15 held out" in toml, toml
    run = tmp_path / "run"
    launcher = start(_folder_args(tmp_path / "shapes", run, total))
    wait_for(lambda: rows_written(run, 1) > 40, launcher, "training", timeout=120)
    loaders = [child for rank in (0, 1) for child in worker_process(launcher.pid, rank).children()]
    assert len(loaders) >= 4  # 2 DataLoader processes per training worker (rank 0: its evaluation's too)
    os.killpg(launcher.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 130, err
    assert not [p for p in loaders if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not (run / "model.pt").exists()
    assert main(["train", "--resume", str(run)]) == 0
    resumed, want = torch.load(run / "model.pt"), torch.load(straight / "model.pt")
    assert resumed.keys() == want.keys()
    for key, tensor in want.items():  # batch norm's counters too (integers: equal)
        if tensor.is_floating_point():
            assert float((resumed[key] - tensor).norm() / tensor.norm().clamp_min(1e-12)) < 1e-6, key
        else:
            assert torch.equal(resumed[key], tensor), key


@pytest.mark.timeout(120)
def test_the_loader_processes_die_with_a_killed_worker(tmp_path: Path) -> None:
    make(tmp_path / "shapes", classes=3, per_class=20, size=16)
    run = tmp_path / "run"
    launcher = start(["--data", str(tmp_path / "shapes" / "train"), "--model", "mlp", "--image-size", "8",
                      "--iterations", "100000", *TINY, "--out", str(run)])
    wait_for(lambda: rows_written(run, 1) > 20, launcher, "training", timeout=90)
    victim = worker_process(launcher.pid, 1)
    loaders = victim.children()
    assert len(loaders) == 2  # --loader-workers 2 by default
    victim.kill()
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 1 and "SIGKILL" in err, err
    deadline = time.monotonic() + 5
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in loaders) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in loaders if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
