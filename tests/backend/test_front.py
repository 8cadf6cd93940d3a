"""The ``shm`` backend's C++ front (``backend/front.py``): small float32 SUM/AVG allreduces,
barriers, broadcasts and all_gather_into_tensor are finished there, to the Python path's
bits at 2, 3 and 4 ranks (the sums gloo's at 2, the moves gloo's at every size); the rest goes to the
Python backend; a rank without the front works with ranks that have it; the front's build
folder is refused where others can write it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shmtrain.backend import front
from support.backend_runs import run_case
from support.paths import SUPPORT

pytestmark = pytest.mark.timeout(180)
SCRIPT = str(SUPPORT / "front_script.py")
ALLREDUCES = 3 * 2 + 1  # small, empty and whole-payload SUM and AVG, and the one that requires grad


def _front() -> None:
    if front.module() is None:
        pytest.skip(f"no C++ front here: {front.why_not}")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_small_calls_take_the_front_and_equal_gloos_bits(world: int) -> None:
    _front()
    results = run_case("front", world, script=SCRIPT)
    for result in results.values():
        assert result["front"] == "Front", result
        assert all(result["equal"].values()), result["equal"]  # the Python path's bits
        # gloo's bits at 2 ranks (a sum of two terms has one order); more terms: gloo sums in its own order
        sums = [key for key in result["gloo"] if key.split()[0] in ("small", "empty", "whole")]
        assert all(result["gloo" if world == 2 else "close"][key] for key in sums), result
        moved = [key for key in result["gloo"] if key not in sums]  # broadcast and all_gather: exact
        assert len(moved) == 3 * (world + 1) and all(result["gloo"][key] for key in moved), result
        assert result["bumped"], "the allreduce did not bump the tensor's version"
        calls = ALLREDUCES + 3 + 3 * (world + 1)  # and the barriers, broadcasts and all_gathers
        assert result["fast"] == calls and result["fast_after"] == calls, result  # large and float64: Python's
        assert result["reductions"] == 2 * (3 * 2) + 1 + 2, result  # every allreduce counted, whichever path
        shm = result["through_shm"]
        assert shm["barrier"] == 3 and shm["all_reduce"] == 15 and shm["broadcast"] == 3 * world, result
        assert shm["all_gather_into_tensor"] == 3, result


def test_a_rank_without_the_front_works_with_ranks_that_have_it() -> None:
    """The wire is the same: rank 1 on the Python backend alone, rank 0 through the front."""
    _front()
    by_rank = run_case("front", 2, script=SCRIPT,
                       per_rank={0: {"SHMTRAIN_PG_FRONT": "1"}, 1: {"SHMTRAIN_PG_FRONT": "0"}})
    assert all(by_rank[0]["equal"].values()) and all(by_rank[1]["equal"].values()), by_rank
    assert by_rank[0]["front"] == "Front" and by_rank[0]["fast"] == ALLREDUCES + 3 + 3 * 3
    assert by_rank[1]["front"] == "ShmBackend" and by_rank[1]["fast"] == 0


def test_a_call_whose_peer_is_late_is_finished_by_the_python_backend() -> None:
    """Rank 1 comes 0.2 s late to an allreduce, a broadcast, an all_gather and a barrier:
    rank 0's front waits past its slice and hands each call to the Python backend, which
    finishes it to gloo's result; rank 1, on time there, finishes every call in the front."""
    _front()
    by_rank = run_case("late", 2, script=SCRIPT)
    for result in by_rank.values():
        assert all(result["equal"].values()), result
    assert by_rank[0]["fast"] == 0 and by_rank[1]["fast"] == 4, by_rank
    assert by_rank[0]["through_shm"] == by_rank[1]["through_shm"], by_rank  # counted alike on either path


@pytest.mark.timeout(60)
def test_a_front_folder_others_can_write_is_not_loaded(tmp_path: Path) -> None:
    """Its module's code runs: a planted, world-writable build folder is refused with the
    reason, and the Python backend serves (nothing is built or loaded there)."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    env = dict(os.environ, SHMTRAIN_CACHE=str(cache))
    probe = "from shmtrain.backend import front; print(front.folder())"
    where = Path(subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                                timeout=50, check=True).stdout.strip())
    where.mkdir()
    where.chmod(0o777)
    probe = "from shmtrain.backend import front; print(front.module(), '|', front.why_not)"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=50)
    if "no compiled library" in done.stdout:
        pytest.skip("no compiled library: the front is never built")
    assert done.stdout.startswith("None | "), done.stdout + done.stderr
    assert f"{where} is not a folder of this user's that others cannot write" in done.stdout, done.stdout
    assert list(where.iterdir()) == []  # nothing was built there


@pytest.mark.timeout(120)
def test_a_failed_build_is_remembered_not_retried_by_every_process(tmp_path: Path) -> None:
    """A build that fails (here: a C++ compiler that always fails) leaves its reason in the
    build folder; the next process reads it instead of building again, and says how to retry."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    env = dict(os.environ, SHMTRAIN_CACHE=str(cache), CXX="false")
    probe = "from shmtrain.backend import front; print(front.module(), '|', front.why_not)"
    first = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=100)
    if "no compiled library" in first.stdout:
        pytest.skip("no compiled library: the front is never built")
    assert first.stdout.startswith("None | cannot build or load the C++ front"), first.stdout + first.stderr
    failed = next(cache.glob("pg_front-*/build-failed"))
    second = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=50)
    assert second.stdout.startswith("None | cannot build or load the C++ front"), second.stdout
    assert f"(remove {failed} to try again)" in second.stdout and "building" not in second.stderr, second
