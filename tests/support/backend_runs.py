"""Runs of ``backend_ops_script.py`` for the backend's tests (tests/backend/test_ops.py,
test_calls.py): every rank a process on the ``shm`` backend, their reports."""

from __future__ import annotations

import json
import subprocess
import sys

from support.paths import SUPPORT
from support.torchrun import env, free_port

SCRIPT = str(SUPPORT / "backend_ops_script.py")

#: every op the backend declares, by the name its counts use
OPS = {"all_reduce", "all_reduce_coalesced", "broadcast", "all_gather", "all_gather_into_tensor",
       "all_gather_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter", "reduce_scatter_tensor",
       "reduce_scatter_tensor_coalesced", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter", "barrier"}


def run_case(case: str, world: int, local_world: int | None = None, reporting: int | None = None,
             script: str = SCRIPT, per_rank: dict[int, dict[str, str]] | None = None,
             **extra: str) -> dict[int, dict]:
    """Every rank's report of ``case`` (hosts of ``local_world`` ranks; default one host;
    ``reporting``: how many ranks report, default all) of ``script`` (``CASE RANK PORT
    WORLD``; default ``backend_ops_script.py``); ``per_rank``: environment of single ranks."""
    port = str(free_port())
    if local_world:
        extra["LOCAL_WORLD_SIZE"] = str(local_world)
    per_rank = per_rank or {}
    procs = [subprocess.Popen([sys.executable, script, case, str(r), port, str(world)],
                              env={**env(), **extra, **per_rank.get(r, {})}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    try:
        outputs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), outputs
    world = reporting or world
    results = {}
    for out in outputs:
        for line in out.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
                results[result["rank"]] = result
    assert sorted(results) == list(range(world)), outputs
    return results
