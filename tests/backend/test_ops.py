"""The ``shm`` backend's collectives against gloo's and their definitions: every op and dtype
inside a host equal to gloo's bit for bit, through shared memory (counted per op); AVG of
integers as NCCL's ``ncclAvg`` (the sum in the tensor's type, wrapping around, divided by
the ranks rounding toward zero), in one host and across hosts."""

from __future__ import annotations

import pytest
import torch

from support.backend_ops_script import INTEGERS, inputs
from support.backend_runs import OPS, run_case

pytestmark = pytest.mark.timeout(180)


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
    results = run_case("avg_int", world, local_world)
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


@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])  # 25-40 s each
def test_every_op_and_dtype_equals_gloo_through_shared_memory(world: int) -> None:
    """In one host of 2, 3 and 4 ranks: each op of ``backend_ops_script.every_op`` (every
    reduction of every dtype gloo has, two sizes, one over several blocks of the ring;
    broadcast, gather, scatter from the first and the last rank; uneven all_to_all splits;
    strided tensors; the coalesced forms) equals what a gloo group of the same ranks
    returns, bit for bit (whole-number inputs: the sums and products are exact), and went
    through shared memory: no call fell back to gloo."""
    results = run_case("every_op", world)
    for rank, result in results.items():
        outputs = result["outputs"]
        assert outputs["mismatches"] == [], (rank, outputs["mismatches"][:5])
        assert outputs["checked"] == 459, outputs["checked"]
        # gloo has no complex gather: the one case not compared
        assert all(line.startswith("gather torch.complex64") for line in outputs["gloo_lacks"]), outputs["gloo_lacks"]
        assert set(result["through_shm"]) == OPS, sorted(OPS - set(result["through_shm"]))
        assert result["through_gloo"] == {} and result["fallbacks"] == 0, result["through_gloo"]


@pytest.mark.parametrize("first", ["all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_to_all_single",
                                   "barrier", "all_reduce MAX", "all_gather_into_tensor large",
                                   "reduce_scatter_tensor large"])
def test_a_peer_that_dies_fails_every_ops_work_naming_it(first: str) -> None:
    """Rank 1 exits; rank 0's ``first`` op, waiting for it, fails at once naming the dead
    rank and the op; every op called after it fails too, naming the same cause."""
    results = run_case("peer_dies", 2, reporting=1, FIRST_OP=first, SHMTRAIN_PG_THREAD="0")
    outputs = results[0]["outputs"]
    failed = outputs[first]
    assert failed["raised"] == "ShmBackendError", failed
    op = first.split()[0]
    assert f"{op} #" in failed["text"] and "rank 1 (pid" in failed["text"] and "died" in failed["text"], failed
    assert failed["seconds"] < 30  # found dead, not waited out (the group's timeout is 60 s)
    assert len(outputs) == 15
    for name, later in outputs.items():
        assert later["raised"] == "ShmBackendError", (name, later)
        assert "rank 1 (pid" in later["text"] and "died" in later["text"], (name, later["text"])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_compiled_ring_equals_gloo_and_the_python_path(world: int) -> None:
    """The ops' ring in C (``ring_native.c``): float32 reduce_scatter_tensor, all_reduce and
    reduce of every reduction, all_gather_into_tensor (in place, as FSDP2 calls it, and not),
    broadcast and gather, of uneven sizes over several blocks, equal to gloo's bit for bit
    (random floats; whole numbers for the sums and products of 3 and 4 ranks, where gloo adds
    in an order of its own), and to the Python path's (``SHMTRAIN_NATIVE=0``) on random
    floats and with NaNs, infinities and zeros of opposite signs in some blocks (which the
    compiled path hands back to torch), on every rank."""
    compiled = run_case("compiled_ring", world)
    python = run_case("compiled_ring", world, SHMTRAIN_NATIVE="0")
    for rank in range(world):
        got, ref = compiled[rank]["outputs"], python[rank]["outputs"]
        assert got["compiled"] and not ref["compiled"], (got["compiled"], ref["compiled"])
        for outputs in (got, ref):
            assert outputs["mismatches"] == [], (rank, outputs["mismatches"][:5])
            assert outputs["checked"] == 2 * (5 + 3 + 5 + 2 + 4), outputs["checked"]
        assert got["digests"] == ref["digests"], rank
        assert got["special"] == ref["special"], rank
        # every destination's first block of each special call went to torch: at least one a call
        assert got["handed_back"] >= 5 + 3, got["handed_back"]
        assert ref["handed_back"] == 0
        assert compiled[rank]["through_gloo"] == {}, compiled[rank]["through_gloo"]


def test_the_compiled_ring_on_the_reduction_thread() -> None:
    """The same calls queued for the group's reduction thread (``SHMTRAIN_PG_THREAD=1``, its
    waits sleep at once): gloo's results, special blocks handed back to torch."""
    results = run_case("compiled_ring", 3, SHMTRAIN_PG_THREAD="1")
    for rank, result in results.items():
        outputs = result["outputs"]
        assert outputs["compiled"] and outputs["mismatches"] == [], (rank, outputs["mismatches"][:5])
        assert outputs["checked"] == 2 * (5 + 3 + 5 + 2 + 4) and outputs["handed_back"] >= 5 + 3, outputs["handed_back"]
