"""``shmtrain bench allreduce --peers``: every implementation in one run,
and a peer that cannot run here is reported with its reason instead of figures."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from shmtrain.cli import main

pytestmark = pytest.mark.timeout(300)


def test_every_peer_is_measured_or_says_why(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    assert main(["bench", "allreduce", "--procs", "2", "--sizes", "4KiB", "64KiB", "--reps", "3",
                 "--peers", "gloo", "mpich", "deepspeed", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    for impl in ("shm", "shm-private", "gloo"):
        got = {r["bytes"]: r for r in rows if r["impl"] == impl}
        assert set(got) == {4096, 65536}, impl
        assert all(r["correct"] and r["median_s"] <= r["p90_s"] for r in got.values()), impl
    for peer, module in (("mpich", "mpi4py"), ("deepspeed", "deepspeed")):
        mine = [r for r in rows if r["impl"] == peer]
        if importlib.util.find_spec(module) is None:  # CI installs only .[test]
            assert len(mine) == 1 and "not installed" in mine[0]["reason"]
        else:
            assert all("reason" in r or r["correct"] for r in mine), mine


def test_an_unknown_peer_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "allreduce", "--peers", "nccl"]) == 2
    assert "--peers nccl: unknown; choose from gloo mpich deepspeed" in capsys.readouterr().err
