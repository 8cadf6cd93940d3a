"""The ``shm`` backend's call ring (``backend/calls.py``): a small call's data travels with its
header, so the call is one hand-off (no block of the ops' ring nor of the pipeline); a large
call's header goes alone, then its data through the ring or the pipeline. Both ways on the
compiled path and on the Python one (``SHMTRAIN_NATIVE=0``), with right results."""

from __future__ import annotations

import pytest

from support.backend_runs import OPS, run_case

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("native", ["1", "0"])
def test_a_small_call_is_one_hand_off_and_a_large_one_goes_through_the_rings(native: str) -> None:
    results = run_case("hand_offs", 2, SHMTRAIN_NATIVE=native)
    for rank, result in results.items():
        calls = result["outputs"]
        assert len(calls) == 18, sorted(calls)
        for name, call in calls.items():
            assert call["right"], (rank, name, call)
            assert call["calls"] == 1, (rank, name, call)  # one header hand-off a call, whatever its size
            moved = call["ring_blocks"] + call["pipeline_blocks"]
            if name.endswith("small"):
                assert moved == 0, (rank, name, call)  # the data came with the header
            else:
                assert moved >= 1, (rank, name, call)
        assert result["through_gloo"] == {} and result["fallbacks"] == 0, result["through_gloo"]


def test_with_a_reduction_thread_a_small_call_runs_on_the_callers_thread() -> None:
    """Handing a small call to the thread and back would cost more than the call: it runs
    where it is called (its Work done when returned, async_op=True too); a large call goes
    to the thread."""
    results = run_case("threads", 2, SHMTRAIN_PG_THREAD="1")
    for rank, result in results.items():
        out = result["outputs"]
        assert out["inline"] is False and out["small_done_at_once"] is True, (rank, out)
        assert out["queued_after_small"] == 0 and out["queued_after_large"] == 1, (rank, out)
        assert out["values"] == [4.0, 2.0], (rank, out)  # 1 -> 2 (SUM) -> 2 -> 2 (MAX) -> 4 (SUM); 1 -> 2


@pytest.mark.slow  # 25-40 s
def test_every_op_and_dtype_equals_gloo_on_the_python_path() -> None:
    """``backend_ops_script.every_op`` (as ``test_ops``) without the compiled library: the call
    ring's Python hand-off and sums give gloo's results too."""
    results = run_case("every_op", 2, SHMTRAIN_NATIVE="0")
    for rank, result in results.items():
        outputs = result["outputs"]
        assert outputs["mismatches"] == [], (rank, outputs["mismatches"][:5])
        assert outputs["checked"] == 459, outputs["checked"]
        assert set(result["through_shm"]) == OPS and result["through_gloo"] == {}, result["through_gloo"]
