"""A sparse SUM allreduce inside a host goes through shared memory and equals gloo's bit
for bit (``backend/sparse.py``): duplicate indices, uneven counts of non-zeros and an
empty input, at 2, 3 and 4 ranks; none of the calls goes to gloo."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.paths import SUPPORT
from support.torchrun import env, free_port

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_sparse_sum_equals_gloos_through_shared_memory(world: int) -> None:
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(SUPPORT / "sparse_script.py"), str(r), port, str(world)],
                              env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    try:
        outputs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), outputs
    results = [json.loads(line[len("RESULT "):]) for out in outputs for line in out.splitlines()
               if line.startswith("RESULT ")]
    assert sorted(r["rank"] for r in results) == list(range(world)), outputs
    for result in results:
        assert result["equal"] and all(result["equal"].values()), result["equal"]
        assert result["through_shm"].get("all_reduce") == 9, result  # 3 dtypes x 3 cases
        assert "all_reduce" not in result["through_gloo"], result
