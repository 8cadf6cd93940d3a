"""NEURON and HP-SEARCH experiments: small runs write their plots and numbers; the
in-process NEURON engine equals the real strategies; bad input is a clear error."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from shmtrain.experiments import hpsearch, neuron
from shmtrain.experiments.hpsearch import SearchConfig, run_hpsearch
from shmtrain.experiments.neuron import NeuronConfig, run_neuron, simulate


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shmtrain experiment")
    sub = p.add_subparsers(dest="experiment", required=True)
    neuron.add_experiment_parsers(sub)
    hpsearch.add_experiment_parsers(sub)
    return p


def test_neuron_small_run_writes_plots_and_agrees_with_the_real_strategies(tmp_path: Path) -> None:
    cfg = NeuronConfig(workers=(2, 4), steps=300, eval_every=50, check_workers=2, check_steps=40)
    doc = run_neuron(tmp_path, cfg, log=lambda *_: None)
    for name in ("neuron.json", "neuron_loss.png", "neuron_eval.png"):
        assert (tmp_path / name).stat().st_size > 1000, name
    saved = json.loads((tmp_path / "neuron.json").read_text())
    assert set(saved["runs"]) == {"grad/2", "grad/4", "weight/2", "weight/4"}
    assert len(saved["runs"]["grad/4"]["loss"]) == 300 and len(saved["runs"]["grad/4"]["eval"]) == 6
    # the in-process engine is the real ps_grad / ps_weight run, to float32 round-off
    for mode in ("grad", "weight"):
        check = doc["cross_check"][mode]
        assert check["max_abs_loss_difference"] < 1e-5, mode
        assert np.allclose(check["final_weights_processes"], check["final_weights_in_process"], atol=1e-5)
    # the neuron learns: the loss on the grid falls
    evals = saved["runs"]["grad/2"]["eval"]
    assert evals[-1] < 0.6 * evals[0]


def test_neuron_processes_engine_runs_the_strategies(tmp_path: Path) -> None:
    cfg = NeuronConfig(workers=(2,), steps=30, eval_every=10, engine="processes", average_interval=4)
    doc = run_neuron(tmp_path, cfg, log=lambda *_: None)
    assert doc["runs"]["weight/2"]["engine"] == "processes"
    assert doc["cross_check"] is None
    sim = simulate(cfg, 2, "weight")
    assert np.allclose(doc["runs"]["weight/2"]["loss"], sim["loss"], atol=1e-5)


def test_weight_averaging_with_a_long_interval_differs_from_gradient_averaging() -> None:
    cfg = NeuronConfig(steps=200, average_interval=25)
    grad, weight = simulate(cfg, 4, "grad"), simulate(cfg, 4, "weight")
    assert np.max(np.abs(grad["loss"] - weight["loss"])) > 1e-3
    same = simulate(NeuronConfig(steps=200, average_interval=1), 4, "weight")
    assert np.max(np.abs(grad["loss"] - same["loss"])) < 1e-5  # eq. 2.3 with equal starts


@pytest.mark.parametrize("argv,match", [
    (["neuron", "--out", "x", "--average-interval", "0"], "--average-interval 0"),
    (["neuron", "--out", "x", "--lr", "-1"], "--lr"),
    (["neuron", "--out", "x", "--workers", "2,0"], "--workers"),
    (["neuron", "--out", "x", "--check-steps", "-3"], "--check-steps"),
    (["hpsearch", "--out", "x", "--lrs", "0.1,-0.5"], "--lrs"),
    (["hpsearch", "--out", "x", "--batch-sizes", "0"], "--batch-sizes"),
    (["hpsearch", "--out", "x", "--threshold", "0"], "--threshold"),
    (["hpsearch", "--out", "x", "--samples", "0"], "--samples"),
    (["hpsearch", "--out", "x", "--model", "nosuchnet"], "--model 'nosuchnet' is unknown"),
    (["hpsearch", "--out", "x", "--batch-sizes", "4096"], "no valid point"),
    (["hpsearch", "--out", "x", "--samples", "20", "--batch-sizes", "16"], "no valid point"),
])
def test_bad_input_is_a_clear_error(argv: list[str], match: str, tmp_path: Path) -> None:
    args = parser().parse_args([a.replace("x", str(tmp_path / "out")) if a == "x" else a for a in argv])
    with pytest.raises(ValueError, match=match):
        args.handler(args)
    assert not list(tmp_path.glob("out/*.png"))


def test_hpsearch_small_grid_marks_diverged_runs_and_picks_a_kept_winner(tmp_path: Path) -> None:
    args = parser().parse_args(["hpsearch", "--out", str(tmp_path), "--workers", "1,2", "--batch-sizes", "16,32",
                                "--lrs", "0.9,1000", "--samples", "1024", "--threshold", "1.8"])
    assert args.handler(args) == 0
    doc = json.loads((tmp_path / "hpsearch.json").read_text())
    for name in ("hpsearch_heatmaps.png", "hpsearch_areas.png", "hpsearch_best_losses.png"):
        assert (tmp_path / name).stat().st_size > 1000, name
    runs = {(r["workers"], r["batch"], r["lr"]): r for r in doc["runs"]}
    assert len(runs) == 8
    assert all(r["status"] == "diverged" and r["area_time"] is None for r in runs.values() if r["lr"] == 1000.0)
    for n in ("1", "2"):
        best = doc["best"][n]
        assert best["lr"] == 0.9 and best["min_loss"] <= 1.8 and best["area_time"] > 0
    # constant samples seen: iterations x workers x batch is the same for every run
    assert {r["iterations"] * r["workers"] * r["batch"] for r in runs.values()} == {1024}
    # 1 worker x 32 and 2 workers x 16 train on the same union batches: eq. 2.1 gives the
    # same loss curve (only the time differs)
    assert np.allclose(runs[(1, 32, 0.9)]["loss"], runs[(2, 16, 0.9)]["loss"], atol=1e-5)


def test_hpsearch_threshold_that_excludes_every_run_is_a_clear_error(tmp_path: Path) -> None:
    cfg = SearchConfig(workers=(1,), batch_sizes=(64,), lrs=(0.1,), samples=256, threshold=1e-4)
    with pytest.raises(ValueError, match="--threshold 0.0001 excludes every run: the lowest minimum loss was"):
        run_hpsearch(tmp_path, cfg, log=lambda *_: None)
    assert (tmp_path / "hpsearch.json").exists()
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.slow
def test_neuron_with_default_settings(tmp_path: Path) -> None:
    args = parser().parse_args(["neuron", "--out", str(tmp_path)])
    assert args.handler(args) == 0
    assert len(json.loads((tmp_path / "neuron.json").read_text())["runs"]) == 8


@pytest.mark.slow
def test_hpsearch_with_default_settings(tmp_path: Path) -> None:
    args = parser().parse_args(["hpsearch", "--out", str(tmp_path)])
    assert args.handler(args) == 0
    assert set(json.loads((tmp_path / "hpsearch.json").read_text())["best"]) == {"1", "2", "4"}
