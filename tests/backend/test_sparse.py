"""A sparse SUM allreduce inside a host goes through shared memory and equals gloo's bit
for bit (``backend/sparse.py``): duplicate indices, uneven counts of non-zeros and an
empty input, at 2, 3 and 4 ranks; none of the calls goes to gloo."""

from __future__ import annotations

import pytest

from support.backend_runs import run_case
from support.paths import SUPPORT

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_sparse_sum_equals_gloos_through_shared_memory(world: int) -> None:
    results = run_case("sum", world, script=str(SUPPORT / "sparse_script.py"))
    for result in results.values():
        assert result["equal"] and all(result["equal"].values()), result["equal"]
        assert result["through_shm"].get("all_reduce") == 9, result  # 3 dtypes x 3 cases
        assert "all_reduce" not in result["through_gloo"], result
