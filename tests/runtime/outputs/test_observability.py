"""What a run shows while and after it trains: lr and t0 in every metrics row, held-out
evaluations, plot.png, TensorBoard, trace.json, ``shmtrain compare``.

Two launches in all (module fixtures): a 2-worker ssgd run with a cosine schedule,
``--eval-every 4 --trace --tensorboard``, and a 1-worker run to compare it with.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

from conftest import run_main
from shmtrain.cli import main
from shmtrain.fabric.shm.segment import leftover
from shmtrain.runtime.outputs.report import read_evals, read_metrics
from shmtrain.runtime.outputs.trace import LEAVES, OTHER, build_trace

ITERATIONS, EVERY, WARMUP, LR = 12, 4, 2, 0.05
HAVE_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


def shmtrain(*args: str) -> subprocess.CompletedProcess:
    """:func:`conftest.run_main`; module fixtures call it before the per-test leak check
    (conftest) starts, so it checks for leaked segments itself."""
    before = set(leftover())
    result = run_main(*args, "--no-progress")
    assert not set(leftover()) - before, f"leaked shared-memory segments: {set(leftover()) - before}"
    return result


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 workers, ssgd, cosine with warm-up, evaluation every 4 iterations, trace, TensorBoard."""
    out = tmp_path_factory.mktemp("obs") / "ssgd-cosine"
    extra = ["--tensorboard"] if HAVE_TENSORBOARD else []
    result = shmtrain("train", "--workers", "2", "--batch-size", "16", "--iterations", str(ITERATIONS),
                      "--lr", str(LR), "--lr-schedule", "cosine", "--warmup-iterations", str(WARMUP),
                      "--eval-every", str(EVERY), "--trace", *extra, "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "trace.json" in result.stdout
    return out


@pytest.fixture(scope="module")
def other_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run to compare with: one process, a step schedule, evaluation each epoch."""
    out = tmp_path_factory.mktemp("obs") / "single-step"
    result = shmtrain("train", "--strategy", "single", "--workers", "1", "--batch-size", "128",
                      "--iterations", "6", "--lr-schedule", "step", "--lr-step-every", "2",
                      "--out", str(out))
    assert result.returncode == 0, result.stderr
    return out


def reference_lrs() -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = SequentialLR(opt, [LinearLR(opt, 1 / (WARMUP + 1), 1.0, WARMUP),
                               CosineAnnealingLR(opt, T_max=ITERATIONS - WARMUP)], milestones=[WARMUP])
    values = []
    for _ in range(ITERATIONS):
        values.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return values


def test_every_row_has_the_schedules_lr_and_a_start_time(run: Path) -> None:
    rows = read_metrics(run)
    assert sorted(rows) == [0, 1]
    for rank_rows in rows.values():
        assert [r["iteration"] for r in rank_rows] == list(range(1, ITERATIONS + 1))
        assert [r["lr"] for r in rank_rows] == reference_lrs()
        starts = [r["t0"] for r in rank_rows]
        assert starts == sorted(starts)


def test_evaluations_at_4_8_12_on_rank_0_outside_the_iterations(run: Path) -> None:
    evals = read_evals(run)
    assert list(evals) == [0]
    assert [e["iteration"] for e in evals[0]] == [4, 8, 12]
    for e in evals[0]:
        assert 0 <= e["accuracy"] <= 1 and e["loss"] > 0 and e["time"] > 0
    rows = {r["iteration"]: r for r in read_metrics(run)[0]}
    for e in evals[0][:-1]:  # between the end of its iteration and the start of the next
        before, after = rows[e["iteration"]], rows[e["iteration"] + 1]
        assert before["t0"] + before["time"]["iteration"] <= e["t0"] + 2e-6
        assert e["t0"] + e["time"] <= after["t0"] + 2e-6
    summary = json.loads((run / "summary.json").read_text())
    assert summary["evaluations"] == 3 and summary["held_out_loss"] == evals[0][-1]["loss"]
    assert summary["iterations"] == ITERATIONS and summary["accuracy"] is not None
    assert (run / "plot.png").stat().st_size > 10_000


def test_trace_has_a_track_per_rank_and_phases_that_sum_to_the_iteration(run: Path) -> None:
    trace = json.loads((run / "trace.json").read_text())
    events = trace["traceEvents"]
    names = {(e["name"], e["pid"]): e["args"]["name"] for e in events if e["ph"] == "M" and "name" in e["args"]}
    for rank in (0, 1):
        assert names[("process_name", rank)] == names[("thread_name", rank)] == f"rank {rank}"
    rows = read_metrics(run)
    slices: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    iterations = [e for e in events if e["ph"] == "X" and e.get("cat") == "iteration"]
    assert len(iterations) == 2 * ITERATIONS
    for it in iterations:
        assert it["pid"] == it["tid"]
        inside = [e for e in events if e["ph"] == "X" and e.get("cat") == "phase" and e["pid"] == it["pid"]
                  and it["ts"] <= e["ts"] and e["ts"] + e["dur"] <= it["ts"] + it["dur"]]
        slices[(it["pid"], it["args"]["iteration"])] = inside
        assert [e["name"] for e in inside] == [*LEAVES, OTHER]
        assert all(isinstance(e["ts"], int) and e["dur"] >= 0 for e in inside)
        assert "comm_ms" in it["args"] and "compute_ms" in it["args"]
    for rank, rank_rows in rows.items():
        for row in rank_rows:
            total = row["time"]["iteration"] * 1e6
            leaves = slices[(rank, row["iteration"])]
            assert abs(sum(e["dur"] for e in leaves) - total) <= 0.05 * total
            measured = sum(row["time"][p] for p in LEAVES) * 1e6
            assert sum(e["dur"] for e in leaves[:-1]) == pytest.approx(measured, abs=len(LEAVES))
    evals = [e for e in events if e["name"] == "eval"]
    assert [e["args"]["iteration"] for e in evals] == [4, 8, 12] and {e["pid"] for e in evals} == {0}


@pytest.mark.skipif(not HAVE_TENSORBOARD, reason="pip install 'shmtrain[tensorboard]'")
def test_tensorboard_has_the_scalars(run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert files
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss/train", "lr", "loss/held_out", "accuracy/held_out", "time_ms/forward", "time_ms/comm"} <= tags
    assert [e.step for e in acc.Scalars("accuracy/held_out")] == [4, 8, 12]
    assert [e.value for e in acc.Scalars("lr")] == pytest.approx(reference_lrs(), rel=1e-6)


def test_compare_prints_both_runs_and_writes_the_figure(run: Path, other_run: Path, tmp_path: Path,
                                                        capsys) -> None:
    png = tmp_path / "cmp" / "compare.png"
    assert main(["compare", str(run), str(other_run), "--out", str(png)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "strategy" in lines[0] and "accuracy" in lines[0] and "forward ms" in lines[0]
    row = next(line for line in lines if line.startswith(run.name))
    assert "ssgd" in row and " 2 " in row and f" {ITERATIONS} " in row
    assert next(line for line in lines if line.startswith(other_run.name)).split()[1] == "single"
    assert png.stat().st_size > 10_000
    assert len(read_evals(other_run)[0]) >= 1  # each epoch by default, and at the end


def test_compare_names_a_folder_that_is_not_a_finished_run(tmp_path: Path, capsys) -> None:
    assert main(["compare", str(tmp_path), "--out", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "summary.json" in err and "--out" in err
    assert not (tmp_path / "c.png").exists()


def test_tensorboard_missing_is_exit_2_naming_the_extra(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # find_spec: not installed
    assert main(["train", "--tensorboard", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "--tensorboard" in err and "pip install 'shmtrain[tensorboard]'" in err
    assert not (tmp_path / "r").exists()  # before any folder or worker


def test_trace_of_rows_without_start_times_lays_them_back_to_back() -> None:
    rows = {0: [{"iteration": i, "loss": 1.0, "time": {"data": 0.001, "forward": 0.002, "backward": 0.003,
                                                       "update": 0.001, "comm": 0.004, "iteration": 0.011}}
                for i in (1, 2)]}
    events = [e for e in build_trace(rows)["traceEvents"] if e["ph"] == "X"]
    its = [e for e in events if e["cat"] == "iteration"]
    assert [(e["ts"], e["dur"]) for e in its] == [(0, 11000), (11000, 11000)]
    leaves = [(e["name"], e["ts"], e["dur"]) for e in events if e["cat"] == "phase"][:5]
    assert leaves == [("data", 0, 1000), ("forward", 1000, 2000), ("backward", 3000, 3000),
                      ("update", 6000, 1000), ("other", 7000, 4000)]
