"""The ``shm`` backend's collectives against their definitions: AVG of integers as NCCL's
``ncclAvg`` (the sum in the tensor's type, wrapping around, divided by the ranks rounding
toward zero), in one host and across hosts, every tensor through shared memory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from support.backend_ops_script import INTEGERS, inputs
from support.paths import SUPPORT
from support.torchrun import env, free_port

pytestmark = pytest.mark.timeout(180)
SCRIPT = str(SUPPORT / "backend_ops_script.py")


def _run(case: str, world: int, local_world: int | None = None) -> dict[int, dict]:
    """Every rank's report of ``case`` (hosts of ``local_world`` ranks; default one host)."""
    port = str(free_port())
    extra = {"LOCAL_WORLD_SIZE": str(local_world)} if local_world else {}
    procs = [subprocess.Popen([sys.executable, SCRIPT, case, str(r), port, str(world)],
                              env={**env(), **extra}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    try:
        outputs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), outputs
    results = {}
    for out in outputs:
        for line in out.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
                results[result["rank"]] = result
    assert sorted(results) == list(range(world)), outputs
    return results


def nccl_avg(values: list[list[int]], dtype: torch.dtype) -> list[int]:
    """``ncclAvg`` of integers by its definition, in Python's integers: the ranks' sum wrapped
    into the dtype (two's complement), its absolute value divided by the ranks, the sign back."""
    bits = torch.iinfo(dtype).bits
    signed = torch.iinfo(dtype).min < 0
    out = []
    for column in zip(*values, strict=True):
        total = sum(column) % (1 << bits)
        if signed and total >= 1 << (bits - 1):
            total -= 1 << bits
        quotient = abs(total) // len(values)
        out.append(-quotient if total < 0 else quotient)
    return out


@pytest.mark.parametrize("world,local_world", [(2, None), (3, None), (4, 2)])
def test_avg_of_integers_is_ncclavg_on_every_route(world: int, local_world: int | None) -> None:
    """2 and 3 ranks in one host, 4 as two hosts of 2 (the host sum, gloo among the leaders,
    then NCCL's division); one tensor, a strided one and a coalesced call per dtype."""
    results = _run("avg_int", world, local_world)
    for seed, (name, dtype) in enumerate(INTEGERS.items()):
        shapes = {"one": (1001, seed), "strided": (37, seed + 10), "coalesced0": (5, seed + 20),
                  "coalesced1": (300, seed + 30)}
        for key, (numel, s) in shapes.items():
            expected = nccl_avg([inputs(dtype, numel, s, r).tolist() for r in range(world)], dtype)
            for rank, result in results.items():
                got = result["outputs"][f"{name}/{key}"]
                assert got["dtype"] == name, (rank, key, got["dtype"])
                assert got["values"] == expected, (rank, name, key)
    for result in results.values():  # every tensor through shared memory, none to gloo
        assert result["reductions"] == 4 * len(INTEGERS) and result["fallbacks"] == 0, result


def test_the_definition_rounds_toward_zero_and_wraps() -> None:
    """The reference itself: -7 over 2 ranks is -3 (not the floor's -4); int8 100 + 100
    wraps to -56, whose average is -28; uint8 250 + 10 wraps to 4, whose average is 2."""
    assert nccl_avg([[-3], [-4]], torch.int32) == [-3]
    assert nccl_avg([[100], [100]], torch.int8) == [-28]
    assert nccl_avg([[250], [10]], torch.uint8) == [2]
