"""PyTorch's distributed test suite on the ``shm`` backend: every test of the
collective, DDP (CPU), process-group and join families that passes on gloo passes on shm.

Upstream gates tests to named backends, so shm runs under the label ``gloo``: every group
the suite asks of gloo is built by shm (``tests/support/conformance/upstream_spawn.py``), and each
rank reports the shm groups it built and the tensors it reduced in shared memory, summed
here to prove the shared-memory path ran.

Default suite: the families on shm at world size 2 with forked ranks (~1 min), against
the tests gloo passed in the recorded full run (``tests/support/conformance/gloo_passes.json``;
gloo runs here too when this torch is not the recorded one). Slow: gloo and shm at world
sizes 2, 3 and 4, ranks forked and spawned as upstream does (docs/collectives.md has the
counts of the last full run).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.conformance.compare import EXPLAINED, compare, run

pytest.importorskip("expecttest", reason="PyTorch's test modules need expecttest: pip install -e '.[test]'")
import torch  # noqa: E402

from support.paths import SUPPORT

RECORDED = SUPPORT / "conformance" / "gloo_passes.json"
#: upstream tests in which shm must reduce through shared memory (SUM allreduce, DDP)
THROUGH_SHM = ["test_all_reduce_sum", "test_DistributedDataParallelCPU", "test_ddp_create_graph"]
#: upstream tests of one op each that gloo passes here, and the op's name in the backend's
#: counts per op (upstream runs its all_to_all and *_tensor tests on MPI and NCCL only)
OP_TESTS = {"test_all_reduce_max": "all_reduce", "test_all_reduce_coalesced_min": "all_reduce_coalesced",
            "test_broadcast": "broadcast", "test_all_gather": "all_gather",
            "test_all_gather_coalesced_simple": "all_gather_coalesced", "test_reduce_sum": "reduce",
            "test_gather": "gather", "test_scatter": "scatter", "test_barrier": "barrier"}


def _passed(result: dict) -> set[str]:
    return {t for t, o in result["outcomes"].items() if o["outcome"] == "pass"}


@pytest.mark.slow  # ~65 s: PyTorch's own distributed families on shm and gloo (pytest -m slow, and before a release)
@pytest.mark.timeout(170)
def test_families_pass_on_shm_where_gloo_passes(tmp_path: Path) -> None:
    recorded = json.loads(RECORDED.read_text())
    shm = run("shm", 2, tmp_path, start="fork", timeout=150)
    if recorded["torch"] == torch.__version__:
        expected = set(recorded["gloo_passes"]["2"])
    else:  # another torch: what its gloo passes (one more minute)
        expected = _passed(run("gloo", 2, tmp_path, start="fork", timeout=150))
    assert expected and expected <= set(shm["outcomes"]), "the families' tests changed: re-record"
    failed = {t: shm["outcomes"][t] for t in expected - _passed(shm)}
    unexplained = {t: o for t, o in failed.items() if not (t in EXPLAINED and EXPLAINED[t][0] in o["detail"])}
    assert not unexplained, unexplained
    counts = shm["counts"]
    assert all(counts[t]["groups"] >= 2 for t in _passed(shm)), "a test passed without shm groups"
    assert all(counts[t]["reductions"] > 0 for t in THROUGH_SHM), counts
    # upstream's collective tests ran their op through shared memory, never gloo's
    for test, op in OP_TESTS.items():
        assert counts[test]["shm"].get(op, 0) > 0 and not counts[test]["gloo"].get(op), (test, counts[test])


@pytest.mark.slow
@pytest.mark.timeout(5 * 3600)
@pytest.mark.parametrize("start", ["fork", "spawn"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_family_test_that_passes_on_gloo_passes_on_shm(tmp_path: Path, world_size: int, start: str) -> None:
    row = compare(run("gloo", world_size, tmp_path, start=start, timeout=2 * 3600),
                  run("shm", world_size, tmp_path, start=start, timeout=2 * 3600))
    assert not row["gloo_pass_shm_fail"], row["gloo_pass_shm_fail"]
    assert not row["shm_passed_without_shm_group"], row["shm_passed_without_shm_group"]
    assert row["passed_gloo"] > 50 and row["shm_reductions"] > 0, row
