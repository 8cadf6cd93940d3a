"""Every algorithm of the private-tensor allreduce gives the exact sum, with 16 ranks on
this machine's cores (ranks outnumber them: every wait sleeps), for lengths that divide
into neither the blocks nor the ranks' chunks, in every dtype the ``cpu:shm`` backend
takes (and int64), on the compiled path where it is built and on the Python path."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shmtrain.backend.reducer import FLOATS
from shmtrain.fabric import native
from shmtrain.fabric.allreduce.pipeline import PAGE, PipelinedAllreduce
from shmtrain.fabric.allreduce.plan import Machine
from shmtrain.runtime.launch.launcher import launch

#: two NUMA nodes of one core each, so that the two-level plan has two groups of ranks
TWO_NODES = Machine(nodes=((0,), (1,)), copy_one_Bps=1e10, copy_all_Bps=2e10, handoff_s=1e-6, wake_s=1e-5)
#: not a multiple of 16 elements per rank, of the block (one page), or of anything else
LENGTHS = [16 * 16 + 3, 2 * 1024 + 7]
DTYPES = [*FLOATS, torch.int64]


def algorithms_worker(ctx, payload: dict[str, Any]) -> list[tuple[str, str, bool, int, float]]:
    out = []
    for compiled in (True, False):
        if compiled and native.library() is None:
            continue
        pipe = PipelinedAllreduce(ctx.host, block_bytes=PAGE, native=compiled, machine=TWO_NODES,
                                  tag=f"alg{compiled}")
        for algorithm in ("all-read", "split", "two-level"):
            pipe.use(algorithm)
            for dtype in DTYPES if not compiled else [torch.float32]:
                for numel in LENGTHS:
                    base = torch.arange(numel)
                    mine = ((base + ctx.rank) % 4).to(dtype)  # at most 3: 16 of them sum exactly in bfloat16
                    expected = sum((base + r) % 4 for r in range(ctx.world_size))
                    pipe(mine)
                    error = float((mine.double() - expected.double()).abs().max())
                    out.append((algorithm, str(dtype), compiled, numel, error))
                    assert pipe.last_plan.algorithm == algorithm
            mean = torch.full((LENGTHS[-1],), float(ctx.rank))
            pipe(mean, op="mean")
            out.append((algorithm, "mean", compiled, LENGTHS[-1], float((mean - 7.5).abs().max())))
        pipe.close()
    return out


@pytest.mark.timeout(170)
def test_every_algorithm_sums_exactly_with_16_ranks_on_few_cores() -> None:
    results = launch("fabric.allreduce.test_algorithms:algorithms_worker", 16, {}, timeout=150)
    assert all(r == results[0] for r in results)
    done = {(a, d, c) for a, d, c, _, _ in results[0]}
    assert {a for a, _, _ in done} == {"all-read", "split", "two-level"}
    assert {d for _, d, _ in done} >= {str(t) for t in DTYPES} | {"mean"}
    if native.library() is not None:  # every plan in C too
        assert {(a, "torch.float32", True) for a in ("all-read", "split", "two-level")} <= done
    bad = [r for r in results[0] if r[4] != 0.0]
    assert not bad, bad
