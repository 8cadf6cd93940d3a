"""The rank a failure's one line names is the one that failed: a worker whose loss went
NaN is blamed, not the peer that was waiting for it when it stopped (the buffer service's
accumulate under seasgd, the one-sided exchange of gpi)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_main


@pytest.mark.parametrize("strategy", ["seasgd", "gpi"])
def test_the_rank_whose_loss_went_nan_is_named_not_the_peer_that_waited(tmp_path: Path, strategy: str) -> None:
    done = run_main("train", "--strategy", strategy, "--workers", "3", "--iterations", "200",
                    "--model", "support.odd_models:nan_loss", "--model-args", "rank=1; after=20",
                    "--timeout", "30", "--no-progress", "--out", str(tmp_path / "run"))
    assert done.returncode == 1, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert "worker rank 1 " in line and "rank 1's loss at iteration 20 is nan" in line, done.stderr
    assert "worker rank 0 " not in line and "worker rank 2 " not in line, line
