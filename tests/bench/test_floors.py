"""``shmtrain bench floors`` end to end on few calls: every layer measured, the JSON written,
and a bad size refused naming the option."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shmtrain.bench.floors import LABELS


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
