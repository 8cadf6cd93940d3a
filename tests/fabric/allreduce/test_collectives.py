"""Allreduce schedules (ring, rhd, tree, topo, hierarchical): exact sums in-process and on gloo."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shmtrain.fabric.allreduce.collectives import (
    ALGORITHMS,
    CHOICES,
    CountingTransport,
    GlooTransport,
    InProcessWorld,
    Round,
    ScheduledAllreduce,
    Topology,
    TransportTimeout,
    allreduce,
    build_allreduce,
    check,
    get_algorithm,
    plan_for,
)
from shmtrain.fabric.allreduce.collectives.executor import execute
from shmtrain.runtime.launch.launcher import launch

WORLD_SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 16]
LENGTHS = [0, 1, 7, 1001]  # 1001 divides none of the world sizes above except 7


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def make_input(rank: int, numel: int, seed: int = 0) -> torch.Tensor:
    """Integer-valued float32, so every order of summation gives the exact same sum."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randint(-1000, 1000, (numel,), generator=g).to(torch.float32)


def expected_sum(world: int, numel: int, seed: int = 0) -> torch.Tensor:
    total = torch.zeros(numel, dtype=torch.int64)
    for r in range(world):
        total += make_input(r, numel, seed).to(torch.int64)
    return total.to(torch.float32)


def run_in_process(algorithm: str, topology: Topology, numel: int) -> list[torch.Tensor]:
    world = InProcessWorld(topology.world_size, timeout=30)
    return world.run(
        lambda t: allreduce(algorithm, t, make_input(t.rank, numel), topology)
    )


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_exact_sum_in_process(algorithm, world):
    groups = divisors(world) if algorithm in ("topo", "hierarchical") else [world]
    for numel in LENGTHS:
        want = expected_sum(world, numel)
        for q in groups:
            topology = Topology.uniform(world, q)
            check(ALGORITHMS[algorithm](topology, numel), world, numel)
            for rank, got in enumerate(run_in_process(algorithm, topology, numel)):
                assert torch.equal(got, want), (algorithm, world, q, numel, rank)


@pytest.mark.parametrize("algorithm", ["topo", "hierarchical"])
def test_unequal_groups(algorithm):
    topology = Topology((0, 0, 0, 1, 2, 2, 1))
    want = expected_sum(7, 333)
    for got in run_in_process(algorithm, topology, 333):
        assert torch.equal(got, want)


def test_topo_renumbers_round_robin():
    # Fig. 7's example: 8 nodes, supernodes {0..3} and {4..7}.
    assert Topology.uniform(8, 4).round_robin() == [0, 4, 1, 5, 2, 6, 3, 7]
    # logical rank l lies in group l mod (p/q)
    order = Topology.uniform(16, 4).round_robin()
    assert [r // 4 for r in order] == [i % 4 for i in range(16)]


def test_step_counts():
    for p in (2, 3, 5, 8, 16):
        rounds = list(ALGORITHMS["ring"](Topology.single(p), 64 * p))
        assert len(rounds) == 2 * (p - 1)
        ceil_log = (p - 1).bit_length()
        assert len(list(ALGORITHMS["tree"](Topology.single(p), 10))) == 2 * ceil_log
        core = 1 << (p.bit_length() - 1)
        extra = 2 if core != p else 0
        assert len(list(ALGORITHMS["rhd"](Topology.single(p), 10))) == 2 * (core.bit_length() - 1) + extra


def test_check_rejects_overlapping_round():
    bad = Round.make([0, 1], [1, 0], [0, 2], [4, 6], True, "x")  # 1 receives [0,4), sends [2,6)
    with pytest.raises(ValueError, match="overlapping"):
        check([bad], 2, 8)
    with pytest.raises(ValueError, match="itself"):
        check([Round.make([0], [0], 0, 1, True, "x")], 2, 8)


def test_counting_needs_no_data():
    # 1024 nodes x 1 G elements: the counting transport never allocates the buffer.
    topology = Topology.uniform(1024, 256)
    tally = CountingTransport(topology).run(ALGORITHMS["rhd"](topology, 1 << 30))
    assert tally.steps == 20
    assert tally.phase("reduce-scatter")["bytes_across"] == (1024 - 256) * 4 * (1 << 30) // 1024


def test_in_process_timeout_names_peer():
    world = InProcessWorld(2, timeout=0.2)

    def body(t):
        if t.rank == 0:
            t.exchange([], [(1, torch.empty(3))])  # rank 1 never sends

    with pytest.raises(RuntimeError, match="peer 1") as info:
        world.run(body)
    assert isinstance(info.value.__cause__, TransportTimeout)


def test_unknown_names_are_clear_errors():
    with pytest.raises(ValueError, match="choose one of ring, rhd"):
        get_algorithm("bogus")
    with pytest.raises(ValueError, match=r"--allreduce 'fast'.*shm, gloo, ring, rhd, tree, topo, hierarchical, auto"):
        build_allreduce("fast", None, 10)
    with pytest.raises(ValueError, match="divide"):
        Topology.uniform(6, 4)


def test_scheduled_allreduce_interface_in_process():
    """Two alternating buffers, reduced in place; result(s) is input(s); mean divides."""
    world = InProcessWorld(3, timeout=30)

    def body(t):
        ar = ScheduledAllreduce("rhd", t, 10, op="mean")
        out = []
        for step in (1, 2, 3):
            buf = ar.input()
            assert buf is ar.input(step)
            buf.copy_(make_input(t.rank, 10, seed=step) * 3)
            res = ar()
            assert res is ar.result() is ar.result(step) and ar.count == step
            out.append(res.clone())
        assert ar.input(2) is not ar.input(3)
        return out

    for per_rank in world.run(body):
        for step, got in enumerate(per_rank, start=1):
            assert torch.equal(got, expected_sum(3, 10, seed=step))  # 3 * sum / 3


def test_execute_reuses_plan():
    world = InProcessWorld(5, timeout=30)
    topology = Topology.uniform(5, 5)

    def body(t):
        plan = plan_for(ALGORITHMS["topo"](topology, 50), t.rank)
        outs = []
        for seed in range(3):
            buf = make_input(t.rank, 50, seed)
            outs.append(execute(plan, t, buf).clone())
        return outs

    for per_rank in world.run(body):
        for seed, got in enumerate(per_rank):
            assert torch.equal(got, expected_sum(5, 50, seed))


# -- gloo, across processes -----------------------------------------------------------

GLOO_NUMEL = 1001


def gloo_worker(ctx, numel):
    """Every algorithm over gloo point-to-point, and every ``--allreduce`` object."""
    transport = GlooTransport(timeout=60)
    out = {}
    for q in divisors(ctx.world_size):
        topology = Topology.uniform(ctx.world_size, q)
        for algorithm in ALGORITHMS:
            if q != ctx.world_size and algorithm not in ("topo", "hierarchical"):
                continue  # the others ignore groups
            buf = make_input(ctx.rank, numel)
            allreduce(algorithm, transport, buf, topology)
            out[f"{algorithm}/q{q}"] = buf.numpy().copy()
    for name in CHOICES:
        ar = build_allreduce(name, ctx, numel, op="sum", tag=f"t-{name}", trials=1)
        for step in (1, 2, 3):
            ar.input().copy_(make_input(ctx.rank, numel, seed=step))
            res = ar()
            if not torch.equal(res, ar.result(step)):
                raise AssertionError(f"{name}: result({step}) differs from the call's return")
            out[f"{name}@{step}"] = res.numpy().copy()
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_exact_sum_on_gloo(world):
    results = launch("fabric.allreduce.test_collectives:gloo_worker", world, GLOO_NUMEL, timeout=120)
    want = expected_sum(world, GLOO_NUMEL).numpy()
    for rank, out in enumerate(results):
        keys = [k for k in out if "/q" in k]
        assert len(keys) == len(ALGORITHMS) + 2 * (len(divisors(world)) - 1)
        for key in keys:
            np.testing.assert_array_equal(out[key], want, err_msg=f"{key} rank {rank}")
        for name in CHOICES:
            for step in (1, 2, 3):
                np.testing.assert_array_equal(
                    out[f"{name}@{step}"], expected_sum(world, GLOO_NUMEL, seed=step).numpy(),
                    err_msg=f"--allreduce {name} step {step} rank {rank}",
                )
