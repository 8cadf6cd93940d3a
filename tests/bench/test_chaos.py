"""``shmtrain bench chaos`` kills workers of a real run and checks what it reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)


def test_bench_chaos_kills_replaces_and_compares_bit_for_bit(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    result = subprocess.run([sys.executable, "-m", "shmtrain", "bench", "chaos", "--run", "ssgd", "--workers", "3",
                             "--iterations", "2500", "--every", "1.5", "--json", str(out)],
                            capture_output=True, text=True, timeout=220, env=dict(os.environ, SHMTRAIN_NO_PROGRESS="1"))
    assert result.returncode == 0, result.stdout + result.stderr
    (row,) = json.loads(out.read_text())
    assert row["run"] == "ssgd" and row["workers"] == 3 and row["iterations"] == 2500
    # each kill recovered (in place; a kill that lands on a replacement still forming may restart)
    assert row["kills"] >= 1 and row["replaced"] >= 1 and row["replaced"] + row["restarted"] >= row["kills"] - 1, row
    assert row["exact"] is True and row["kept"] > 0, row
    assert "kept" in result.stdout and "exact" in result.stdout


def test_bad_chaos_input_is_named() -> None:
    result = subprocess.run([sys.executable, "-m", "shmtrain", "bench", "chaos", "--workers", "1"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--workers 1 (at least 2" in result.stderr, result.stderr
