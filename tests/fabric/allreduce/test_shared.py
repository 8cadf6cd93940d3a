"""The shared-memory allreduce: exact sums, means, reuse across steps, any world size."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from shmtrain.fabric.allreduce.shared import ShmAllreduce, split
from shmtrain.runtime.launch.launcher import launch


def allreduce_worker(ctx, payload: dict[str, Any]) -> list[float]:
    numel, steps, op = payload["numel"], payload["steps"], payload["op"]
    ar = ShmAllreduce(ctx.host, numel, op=op)
    errors = []
    base = torch.arange(numel, dtype=torch.float32) % 97  # integer-valued: sums are exact
    for step in range(1, steps + 1):
        ar.input().copy_(base * (ctx.rank + 1) + step)
        result = ar()
        total = sum(base * (r + 1) + step for r in range(ctx.world_size))
        expected = total / ctx.world_size if op == "mean" else total
        errors.append(float((result - expected).abs().max()))
    ar.close()
    return errors


@pytest.mark.parametrize("procs,numel", [(1, 1000), (2, 4099), (3, 100_003), (4, 7)])
def test_sum_is_exact_for_any_world_and_length(procs: int, numel: int) -> None:
    results = launch("fabric.allreduce.test_shared:allreduce_worker", procs, {"numel": numel, "steps": 5, "op": "sum"})
    assert all(err == 0.0 for errors in results for err in errors)


def test_mean_over_four_workers_and_reused_slots() -> None:
    results = launch("fabric.allreduce.test_shared:allreduce_worker", 4, {"numel": 300_001, "steps": 6, "op": "mean"})
    assert len(results) == 4
    assert all(err <= 1e-4 for errors in results for err in errors)


def test_split_covers_every_element_once() -> None:
    for numel in (0, 1, 15, 1024, 100_003):
        for parts in (1, 2, 3, 7):
            chunks = split(numel, parts, granule=16)
            assert chunks[0][0] == 0 and chunks[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False))
            assert all(lo % 16 == 0 for lo, _ in chunks if lo < numel)


def reused_tag_worker(ctx, payload: dict[str, Any]) -> list[float]:
    """Three calls of one allreduce, then a new one of the same tag: the late rank's input
    must be waited for, not taken from the words the first one left at 3."""
    first = ShmAllreduce(ctx.host, 64, op="sum", tag="again")
    for _ in range(3):
        first.input().fill_(1.0)
        first()
    first.close()
    second = ShmAllreduce(ctx.host, 64, op="sum", tag="again")
    if ctx.rank == 1:
        time.sleep(0.3)
    second.input().fill_(float(ctx.rank + 10))
    result = second().clone()
    second.close()
    return result.tolist()


def test_a_tag_used_again_starts_from_zero() -> None:
    for result in launch("fabric.allreduce.test_shared:reused_tag_worker", 2, {}):
        assert result == [21.0] * 64
