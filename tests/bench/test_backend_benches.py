"""``shmtrain bench floors`` and ``shmtrain bench ops`` end to end on few calls: every layer
and op measured and checked, the JSON written, and a bad size refused naming the option."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shmtrain.bench.floors import LABELS
from shmtrain.bench.ops import OPS


@pytest.mark.slow  # ~40 s on the shared 2-core VM: three interpreters, two process groups
def test_bench_floors_measures_every_layer(tmp_path: Path) -> None:
    out = tmp_path / "floors.json"
    result = subprocess.run([sys.executable, "-m", "shmtrain", "bench", "floors", "--reps", "20", "--json", str(out)],
                            capture_output=True, text=True, timeout=170, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr
    figures = json.loads(out.read_text())
    assert figures["bytes"] == 4096 and set(figures["seconds_per_call"]) == set(LABELS)
    assert all(0 < seconds < 1 for seconds in figures["seconds_per_call"].values()), figures
    assert all(label in result.stdout for label in LABELS.values()), result.stdout


def test_bench_floors_refuses_a_size_that_is_not_whole_floats() -> None:
    result = subprocess.run([sys.executable, "-m", "shmtrain", "bench", "floors", "--bytes", "6"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--bytes 6: must be a positive multiple of 4" in result.stderr, result.stderr


@pytest.mark.slow  # ~60 s on the shared 2-core VM: 12 rows of two process groups
@pytest.mark.parametrize("streak", [1, 3])
def test_bench_ops_checks_every_peer_and_goes_through_shared_memory(tmp_path: Path, streak: int) -> None:
    """``shmtrain bench ops`` on 2 processes, one size: each op's rows on shm and gloo,
    every result checked, nothing of shm's handed to gloo; MPICH named when it cannot run.
    ``--streak 3``: samples of 3 calls in a row (the lone first call still checked)."""
    out = tmp_path / "ops.json"
    result = subprocess.run([sys.executable, "-m", "shmtrain", "bench", "ops", "--procs", "2", "--sizes", "4KiB",
                             "--reps", "2", "--streak", str(streak), "--peers", "--json", str(out)],
                            capture_output=True, text=True, timeout=170, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())
    timed = [r for r in rows if "median_s" in r]
    assert {(r["impl"], r["op"]) for r in timed} == {(i, op) for i in ("shm", "gloo") for op in OPS}
    assert all(r["correct"] and r["median_s"] > 0 and r["streak"] == streak for r in timed), timed
    counts = next(r for r in rows if "through_shm" in r)
    assert counts["through_gloo"] == {} and counts["through_shm"]["all_to_all_single"] >= 3, counts
    assert "| all_gather_into_tensor | 2 | 4 KiB |" in result.stdout


@pytest.mark.slow  # ~75 s: FSDP2 on 2 processes, on gloo, on cpu:shm, then on the fake group (--floor)
def test_bench_fsdp_steps_on_both_backends_to_the_same_weights(tmp_path: Path) -> None:
    out = tmp_path / "fsdp.json"
    result = subprocess.run([sys.executable, "-m", "shmtrain", "bench", "fsdp", "--steps", "2", "--floor", "--json",
                             str(out)], capture_output=True, text=True, timeout=170,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr
    gloo, shm, fake = json.loads(out.read_text())
    assert (gloo["backend"], shm["backend"], fake["backend"]) == ("gloo", "cpu:shm", "fake")
    assert shm["bit_identical"] and gloo["weights_sha256"] == shm["weights_sha256"]
    # the floor moved nothing (its weights are not the reduced ones) and is not compared
    assert fake["bit_identical"] is None and fake["weights_sha256"] != gloo["weights_sha256"]
    assert fake["median_s"] > 0 and "floor (fake, no communication)" in result.stdout
    # FSDP2's gathers and reduce-scatters went through shared memory, none to gloo
    assert shm["through_shm"]["all_gather_into_tensor"] > 0 and shm["through_shm"]["reduce_scatter_tensor"] > 0
    assert shm["through_gloo"] == {}, shm["through_gloo"]
