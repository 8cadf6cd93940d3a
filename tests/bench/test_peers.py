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
        assert all(r["cpu_s"] > 0 and r["world_size"] == 2 for r in got.values()), impl
    assert all(r["algorithm"].startswith("all-read/") for r in rows if r["impl"] == "shm-private")  # L = 2
    for peer, module in (("mpich", "mpi4py"), ("deepspeed", "deepspeed")):
        mine = [r for r in rows if r["impl"] == peer]
        if importlib.util.find_spec(module) is None:  # CI installs only .[test]
            assert len(mine) == 1 and "not installed" in mine[0]["reason"]
        else:
            assert all("reason" in r or r["correct"] for r in mine), mine


def test_an_unknown_peer_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "allreduce", "--peers", "nccl"]) == 2
    assert "--peers nccl: unknown; choose from gloo mpich deepspeed" in capsys.readouterr().err


def _fake_rows(world_size: int, value: float, sizes=(4096, 65536)) -> list[dict]:
    """What a peer's rank 0 writes, for a run whose every element came out ``value``."""
    from shmtrain.bench.peers import expected_sum

    return [{"bytes": s, "median_s": 1e-6, "p90_s": 2e-6, "reps": 3, "cpu_s": 1e-6, "world_size": world_size,
             "correct": value == expected_sum(16)} for s in sizes]


def test_a_peer_in_the_wrong_world_or_with_a_wrong_sum_is_invalid_and_never_ranked() -> None:
    from shmtrain.bench.allreduce import comparison, peer_rows
    from shmtrain.bench.peers import validate

    sizes = [4096, 65536]
    assert validate(_fake_rows(16, 136.0), 16, sizes) is None
    # 16 singleton worlds (mpi4py on another MPI than its mpiexec): each "sum" is its own
    # value, which a check against the peer's own world size would have passed
    alone = validate(_fake_rows(1, 1.0), 16, sizes)
    assert alone is not None and "world of 1 ranks, not --procs 16" in alone
    wrong = validate(_fake_rows(16, 135.0), 16, sizes)
    assert wrong is not None and "wrong sum at 4096 bytes (every element must be 136)" in wrong
    assert "no result for 1 of the sizes" in validate(_fake_rows(16, 136.0, sizes=(4096,)), 16, sizes)

    ours = [{"impl": impl, "procs": 16, "bytes": s, "median_s": 1.0, "p90_s": 1.0, "read_floor_s": 1.0,
             "result_floor_s": 1.0, "fresh_read_floor_s": 1.0, "cpu_s": 2.0, "algorithm": "split/512K",
             "correct": True} for impl in ("shm", "shm-private") for s in sizes]
    fast_but_alone = peer_rows("mpich", 16, sizes, {"rows": _fake_rows(1, 1.0)})
    assert len(fast_but_alone) == 1 and fast_but_alone[0]["invalid"] and "median_s" not in fast_but_alone[0]
    honest = peer_rows("deepspeed", 16, sizes, {"rows": [dict(r, median_s=3.0) for r in _fake_rows(16, 136.0)]})
    table = comparison(ours + fast_but_alone + honest)
    assert [r["best_peer"] for r in table] == ["deepspeed", "deepspeed"]  # 1 us MPICH is not ranked
    assert table[0]["mpich_ms"] is None and table[0]["private_vs_best"] == 1.0 / 3.0
    assert table[0]["private_algorithm"] == "split/512K" and table[0]["private_cpu_ms"] == 2000.0
