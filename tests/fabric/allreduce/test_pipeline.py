"""The private-tensor allreduce: exact sums through a ring of blocks,
both paths (all-read, split), any length and dtype, identical bits on every rank, and
the control block's wake-ups (spin, announce, conditional wake, wrap-around)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest
import torch

from conftest import at_once
from shmtrain.fabric import native
from shmtrain.fabric.allreduce.pipeline import PAGE, PipelinedAllreduce, split
from shmtrain.fabric.allreduce.shared import ShmAllreduce
from shmtrain.fabric.shm.affinity import share
from shmtrain.fabric.shm.control import PeerTimeout, _reached
from shmtrain.runtime.launch.launcher import launch

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "int64": torch.int64}


def pipeline_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    dtype = DTYPES[payload["dtype"]]
    pipe = PipelinedAllreduce(ctx.host, block_bytes=payload["block"], split=payload["split"],
                              native=payload.get("native"))
    errors, digests = [], []
    for numel in payload["lengths"]:
        base = torch.arange(numel) % 31  # small integers: every sum is exact in every dtype
        mine = (base * (ctx.rank + 1) + 1).to(dtype)
        pipe(mine, op="sum")
        expected = (base * (ctx.world_size * (ctx.world_size + 1) // 2) + ctx.world_size).to(dtype)
        errors.append(float((mine.double() - expected.double()).abs().max()) if numel else 0.0)
        noisy = torch.randn(numel, generator=torch.Generator().manual_seed(ctx.rank)).mul(100).to(dtype)
        pipe(noisy, op="mean" if noisy.is_floating_point() else "sum")
        digests.append(noisy.double().sum().item() if numel else 0.0)
        digests.append(noisy.view(-1)[: min(numel, 64)].tolist())
    blocks = pipe.blocks
    pipe.close()
    return {"errors": errors, "digests": digests, "blocks": blocks}


needs_native = pytest.mark.skipif(native.library() is None, reason=f"no compiled path: {native.why_not}")


@pytest.mark.parametrize("procs,split,compiled", [
    (2, False, False), (2, True, False), (3, False, False), (4, True, False), (4, False, False),
    pytest.param(2, False, True, marks=needs_native), pytest.param(2, True, True, marks=needs_native),
    pytest.param(3, False, True, marks=needs_native), pytest.param(4, True, True, marks=needs_native),
])
def test_exact_sums_any_length_both_paths(procs: int, split: bool, compiled: bool) -> None:
    lengths = [0, 1, 17, PAGE // 4 - 1, 3 * PAGE + 5, 100_003]
    results = launch("fabric.allreduce.test_pipeline:pipeline_worker", procs,
                     {"dtype": "float32", "block": PAGE * 4, "split": split, "lengths": lengths,
                      "native": compiled})
    assert all(err == 0.0 for r in results for err in r["errors"])
    # the mean of different random inputs: every rank holds the very same bits
    assert all(r["digests"] == results[0]["digests"] for r in results)
    assert results[0]["blocks"] > 2 * len(lengths)  # several blocks per call: the ring was reused


@pytest.mark.parametrize("dtype", ["float64", "bfloat16", "int64"])
def test_other_dtypes(dtype: str) -> None:
    results = launch("fabric.allreduce.test_pipeline:pipeline_worker", 3,
                     {"dtype": dtype, "block": PAGE, "split": None, "lengths": [5, 4099]})
    assert all(err == 0.0 for r in results for err in r["errors"])
    assert all(r["digests"] == results[0]["digests"] for r in results)


def private_worker(ctx, payload: dict[str, Any]) -> float:
    ar = ShmAllreduce(ctx.host, payload["numel"], op="mean")
    worst = 0.0
    for step in range(3):
        mine = torch.full((payload["numel"],), float(ctx.rank + step))
        assert ar.reduce_private(mine) is mine
        worst = max(worst, float((mine - ((ctx.world_size - 1) / 2 + step)).abs().max()))
    ar.close()
    return worst


def test_shm_allreduce_reduce_private_goes_through_the_pipeline() -> None:
    assert max(launch("fabric.allreduce.test_pipeline:private_worker", 2, {"numel": 300_000})) <= 1e-6


def test_bad_tensors_are_refused_before_any_hand_off() -> None:
    messages = launch("fabric.allreduce.test_pipeline:refusing_worker", 2, {})
    assert all("contiguous CPU tensors" in m[0] and "'mean' needs a floating-point" in m[1] for m in messages)


def refusing_worker(ctx, payload: dict[str, Any]) -> list[str]:
    pipe = PipelinedAllreduce(ctx.host)
    messages = []
    for bad, op in ((torch.zeros(4, 4).t(), "sum"), (torch.zeros(4, dtype=torch.int32), "mean")):
        try:
            pipe(bad, op=op)
        except ValueError as e:
            messages.append(str(e))
    ones = torch.ones(3)
    pipe(ones)  # the refusals posted nothing: the ranks are still in step
    assert ones.tolist() == [2.0] * 3
    pipe.close()
    return messages


def test_parts_cover_a_block_once() -> None:
    for m in (1, 16, 17, 1000, 65_536):
        for parts in (1, 2, 3, 4):
            ranges = split(m, parts)
            assert ranges[0][0] == 0 and ranges[-1][1] == m
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


def test_sequence_numbers_compare_across_the_wrap() -> None:
    assert _reached(5, 5) and _reached(6, 5) and not _reached(4, 5)
    top = 2**31 - 1
    assert _reached(-(2**31), top)  # top + 1 wrapped to the smallest int32
    assert not _reached(top, -(2**31))


def paths_worker(ctx, payload: dict[str, Any]) -> list[list[float]]:
    """The compiled and the Python path on the same inputs, one after the other."""
    out = []
    for compiled in (True, False):
        pipe = PipelinedAllreduce(ctx.host, block_bytes=PAGE, split=payload["split"], native=compiled,
                                  tag=f"paths{compiled}")
        x = torch.randn(3000, generator=torch.Generator().manual_seed(ctx.rank))
        pipe(x, op="mean")
        out.append(x.tolist())
        pipe.close()
    return out


@needs_native
@pytest.mark.parametrize("procs,split", [(2, False), (2, True), (4, False)])
def test_compiled_and_python_paths_agree(procs: int, split: bool) -> None:
    results = launch("fabric.allreduce.test_pipeline:paths_worker", procs, {"split": split})
    compiled, python = torch.tensor(results[0][0]), torch.tensor(results[0][1])
    if procs == 2:  # one addition per element: the very same bits
        assert torch.equal(compiled, python)
    else:  # torch.sum may add in another order than rank order
        assert torch.allclose(compiled, python, rtol=1e-6, atol=1e-7)


def late_worker(ctx, payload: dict[str, Any]) -> str:
    pipe = PipelinedAllreduce(ctx.host, block_bytes=PAGE, native=True)
    x = torch.full((5000,), float(ctx.rank + 1))
    message = "ok"
    if ctx.rank == 1:
        time.sleep(payload["delay"])  # rank 0 waits in C through many slices
        if payload["never"]:
            pipe.close()
            return message
    try:
        pipe(x)
        assert x.eq(3.0).all()
    except PeerTimeout as e:
        message = f"timeout: {e} (peer {e.peer})"
    pipe.close()
    return message


@needs_native
def test_compiled_waits_resume_across_slices_and_time_out_naming_the_peer() -> None:
    assert launch("fabric.allreduce.test_pipeline:late_worker", 2, {"delay": 0.4, "never": False}) == ["ok", "ok"]
    first = launch("fabric.allreduce.test_pipeline:late_worker", 2, {"delay": 2.5, "never": True}, timeout=1.0)[0]
    assert first.startswith("timeout: local rank 1") and "a block of the allreduce" in first, first
    assert first.endswith("(peer 1)")


def test_binding_shares_the_allowed_cores() -> None:
    assert [share(r, 4, [0, 1]) for r in range(4)] == [[0], [1], [0], [1]]  # more ranks than cores
    assert [share(r, 2, [2, 3, 5, 7]) for r in range(2)] == [[2, 3], [5, 7]]  # a block each
    assert [share(r, 3, [0, 1, 2, 3]) for r in range(3)] == [[0], [1], [2]]


def test_without_a_compiler_the_python_path_is_taken_and_says_why(tmp_path) -> None:
    code = "from shmtrain.fabric import native; print(native.library() is None, '|', native.why_not)"
    cases = {"no compiler": dict(CC="/bin/false", SHMTRAIN_CACHE=str(tmp_path / "a")),
             "turned off": dict(SHMTRAIN_NATIVE="0", SHMTRAIN_CACHE=str(tmp_path / "b"))}
    for extra in cases.values():
        os.makedirs(extra["SHMTRAIN_CACHE"])
    out = at_once({what: ([sys.executable, "-c", code], dict(os.environ, **extra)) for what, extra in cases.items()})
    assert out["no compiler"].stdout.startswith("True | /bin/false failed"), out
    assert not list((tmp_path / "a").glob("*.so")) and not list((tmp_path / "a").glob("*.tmp"))  # nothing half-built
    assert out["turned off"].stdout.strip() == "True | SHMTRAIN_NATIVE=0", out


def mixed_worker(ctx, payload: dict[str, Any]) -> tuple[bool, float]:
    """Rank 1 refuses the compiled path: every rank must then take the Python one."""
    pipe = PipelinedAllreduce(ctx.host, native=False if ctx.rank == 1 else None)
    x = torch.full((70_000,), float(ctx.rank + 1))
    pipe(x)
    compiled = pipe._lib is not None
    pipe.close()
    return compiled, float((x - 3.0).abs().max())


def test_every_rank_takes_the_same_path() -> None:
    assert launch("fabric.allreduce.test_pipeline:mixed_worker", 2, {}) == [(False, 0.0), (False, 0.0)]


def staggered_worker(ctx, payload: dict[str, Any]) -> int:
    """Rank r calls 0.15 s * r late: rank 0 waits for three peers arriving one by one."""
    pipe = PipelinedAllreduce(ctx.host, block_bytes=PAGE, algorithm="all-read", native=True)
    x = torch.full((100,), float(ctx.rank + 1))
    time.sleep(0.15 * ctx.rank)
    pipe(x)
    assert x.eq(10.0).all()
    wakes = pipe._progress.wakes
    pipe.close()
    return wakes


@needs_native
def test_a_hand_off_wakes_a_sleeper_once_not_once_per_peer() -> None:
    """The compiled wait sleeps on the hand-off's completion word, which the last poster
    sets: rank 0 is woken once, where sleeping on each late peer's word in turn woke it
    once per peer (3 here); 0 would be a lost wake-up (it slept through time slices)."""
    wakes = launch("fabric.allreduce.test_pipeline:staggered_worker", 4, {})
    assert wakes[0] == 1 and max(wakes) <= 1, wakes
