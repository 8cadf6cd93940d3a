"""``shmtrain bench lightning``: its options are checked with the fix named, and on tiny
sizes it writes a row per peer, every peer validated against DDP on gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_main


@pytest.mark.parametrize("words,named", [(["--steps", "5", "--warmup", "5"], "--steps 5 --warmup 5"),
                                         (["--rounds", "0"], "--rounds 0")])
def test_bad_options_are_named_with_the_fix(words: list[str], named: str) -> None:
    done = run_main("bench", "lightning", *words)
    assert done.returncode != 0 and named in done.stderr and "use e.g." in done.stderr, done.stderr


@pytest.mark.slow  # ~100 s on 2 cores: three Lightning fits under torchrun
def test_one_round_writes_a_validated_row_per_peer(tmp_path: Path) -> None:
    pytest.importorskip("lightning", reason="Lightning is not installed (pip install -e '.[test]')")
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, "-m", "shmtrain", "bench", "lightning", "--rounds", "1", "--steps", "6",
                           "--warmup", "2", "--width", "64", "--depth", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=170, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-4000:]
    rows = {row["peer"]: row for row in json.loads(out.read_text())}
    assert set(rows) == {"ddp-gloo", "ddp-shm", "shmtrain"}
    assert all(row["median_ms"] > 0 and row["rounds"] == 1 for row in rows.values())
    assert "every peer's weights equal DDP on gloo's" in done.stdout
