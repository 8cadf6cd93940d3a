"""The private-tensor allreduce's choice of algorithm, checked where it is made: the cost
model takes a described machine, so a 16-core host and a 2-socket 64-core host can be
tested on any machine (wall time on 2 cores cannot show the all-read path's defect:
ranks outnumber cores from L = 3). And the measurement of this machine's parameters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shmtrain.fabric.allreduce import machine_model
from shmtrain.fabric.allreduce.plan import Machine, Plan, choose, predict, rank_groups

#: one socket, 16 cores, 32 MiB of shared cache (the many-core host of the benchmark)
HOST16 = Machine(nodes=(tuple(range(16)),), copy_one_Bps=20e9, copy_all_Bps=120e9, handoff_s=0.5e-6,
                 wake_s=8e-6, cache_bytes=32 << 20)
#: two sockets of 32 cores
HOST2X32 = Machine(nodes=(tuple(range(32)), tuple(range(32, 64))), copy_one_Bps=15e9, copy_all_Bps=250e9,
                   handoff_s=0.8e-6, wake_s=10e-6, cache_bytes=48 << 20)
KiB, MiB = 1 << 10, 1 << 20
#: every size from 256 KiB to 256 MiB: the powers of two, and sizes that divide by nothing
SIZES = [s for k in range(18, 29) for s in (1 << k, (1 << k) + (1 << k) // 2 + 4)]


@pytest.mark.parametrize("machine", [HOST16, HOST2X32], ids=["16-core", "2x32-core"])
@pytest.mark.parametrize("L", [4, 8, 16])
@pytest.mark.parametrize("itemsize", [4, 2])
def test_from_256KiB_up_no_rank_moves_more_than_3x_the_message(machine: Machine, L: int, itemsize: int) -> None:
    for nbytes in SIZES:
        plan = choose(L, nbytes, itemsize, machine)
        worst = max(plan.traffic(r).shared for r in range(L))
        message = plan.numel * itemsize
        assert worst <= 3 * message + plan.block_bytes, (nbytes, plan.algorithm, worst / message)
        assert plan.algorithm != "all-read", (nbytes, plan)  # which reads L times the message


def test_the_all_read_path_is_what_the_bound_rules_out() -> None:
    """The bound can fail: all-read's counted traffic is (L + 1) x the message from L = 3."""
    for L in (4, 8, 16):
        plan = choose(L, 64 * MiB, 4, HOST16, algorithm="all-read")
        assert plan.traffic(0).shared == (L + 1) * 64 * MiB


def test_two_ranks_and_small_messages_keep_the_one_hand_off_path() -> None:
    for machine in (HOST16, HOST2X32):
        plan = choose(2, 4 * KiB, 4, machine)
        assert plan.algorithm == "all-read" and plan.handoffs == 1
        assert choose(2, 256 * MiB, 4, machine).algorithm == "all-read"  # L = 2: one read per byte either way
    assert choose(4, 4 * KiB, 4, HOST16).algorithm == "all-read"


def test_the_two_socket_host_gets_the_two_level_plan() -> None:
    for L in (8, 16):
        assert rank_groups(L, HOST2X32) == (tuple(range(L // 2)), tuple(range(L // 2, L)))
        for nbytes in (1 * MiB, 4 * MiB, 64 * MiB, 256 * MiB):
            plan = choose(L, nbytes, 4, HOST2X32)
            assert plan.algorithm == "two-level", (L, nbytes, plan)
            flat = choose(L, nbytes, 4, HOST2X32, algorithm="split")
            # the point of it: fewer reads of the other socket's memory than the flat split
            assert plan.traffic(0).remote_read < flat.traffic(0).remote_read
    # two ranks per socket: two-level would read m/4 less of the other socket but move m/2
    # more through the ring, so the model keeps the flat split
    four = choose(4, 64 * MiB, 4, HOST2X32)
    assert four.algorithm == "split" and four.predicted_s < choose(4, 64 * MiB, 4, HOST2X32,
                                                                   algorithm="two-level").predicted_s
    assert choose(16, 64 * MiB, 4, HOST16).algorithm == "split"  # one socket: no two-level


def test_counted_bytes_match_the_closed_forms() -> None:
    """Per rank: all-read (L + 1) m, split 3m - 2m/L, two-level with equal groups 3m
    (shared bytes read + written), for a message of whole blocks that split evenly."""
    m = 64 * MiB
    for L in (4, 8, 16):
        plan = Plan("split", L, m // 4, 4, 512 * KiB)
        assert all(plan.traffic(r).shared == 3 * m - 2 * m // L for r in range(L))
        assert all(plan.traffic(r).private_read == m == plan.traffic(r).private_written for r in range(L))
        groups = (tuple(range(L // 2)), tuple(range(L // 2, L)))
        two = Plan("two-level", L, m // 4, 4, 512 * KiB, groups)
        assert all(two.traffic(r).shared == 3 * m for r in range(L))
    assert Plan("all-read", 2, m // 4, 4, 512 * KiB).traffic(1).shared == 2 * m
    uneven = Plan("split", 16, 1_000_003, 4, 512 * KiB)
    assert sum(uneven.traffic(r).shared_written for r in range(16)) == 16 * 4_000_012  # each rank writes m


def test_ranks_outnumbering_cores_make_every_plan_slower() -> None:
    two_cores = Machine(nodes=((0, 1),), copy_one_Bps=20e9, copy_all_Bps=30e9, handoff_s=1e-6, wake_s=20e-6)
    for algorithm in ("all-read", "split"):
        four = predict(choose(4, 4 * MiB, 4, two_cores, algorithm=algorithm), two_cores)
        two = predict(choose(2, 4 * MiB, 4, two_cores, algorithm=algorithm), two_cores)
        assert four > 2 * two


def test_a_bad_description_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"Machine.handoff_s 0 must be a finite number > 0"):
        Machine(nodes=((0,),), copy_one_Bps=1e9, copy_all_Bps=1e9, handoff_s=0)
    with pytest.raises(ValueError, match=r"algorithm 'ring': choose one of all-read, split, two-level"):
        choose(4, 4096, 4, HOST16, algorithm="ring")
    bad = tmp_path / "m.json"
    bad.write_text('{"nodes": [[0]]}')
    monkeypatch.setenv("SHMTRAIN_MACHINE", str(bad))
    with pytest.raises(ValueError, match=rf"SHMTRAIN_MACHINE={bad}: not a machine description"):
        machine_model.machine()


def test_numa_layout_and_cache_from_sysfs(tmp_path: Path) -> None:
    for node, cores in (("node0", "0-3,8"), ("node1", "4-7")):
        (tmp_path / "node" / node).mkdir(parents=True)
        (tmp_path / "node" / node / "cpulist").write_text(cores + "\n")
    assert machine_model.numa_nodes([0, 1, 2, 3, 4, 5, 6, 7, 8], root=tmp_path) == ((0, 1, 2, 3, 8), (4, 5, 6, 7))
    assert machine_model.numa_nodes([4, 5], root=tmp_path) == ((4, 5),)  # nodes without an allowed core drop
    for index, (level, size) in enumerate([(1, "32K"), (2, "1024K"), (3, "36M")]):
        folder = tmp_path / "cpu" / "cpu0" / "cache" / f"index{index}"
        folder.mkdir(parents=True)
        (folder / "level").write_text(f"{level}\n")
        (folder / "size").write_text(f"{size}\n")
    assert machine_model.shared_cache_bytes(0, root=tmp_path) == 36 << 20


def test_measured_once_then_read_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMTRAIN_CACHE", str(tmp_path))
    monkeypatch.delenv("SHMTRAIN_MACHINE", raising=False)
    calls = []

    def fake_measure() -> Machine:
        calls.append(1)
        return HOST16

    monkeypatch.setattr(machine_model, "measure", fake_measure)
    assert machine_model.machine() == HOST16 and machine_model.machine() == HOST16
    assert len(calls) == 1 and machine_model.cache_path().parent == tmp_path
    assert json.loads(machine_model.cache_path().read_text())["copy_one_Bps"] == 20e9
    machine_model.machine(remeasure=True)
    assert len(calls) == 2


def test_this_machine_is_measured() -> None:
    found = machine_model.measure()
    assert found.cores and all(c in found.cores for c in machine_model.allowed_cores())
    assert 1e8 < found.copy_one_Bps < 1e13 and 0 < found.handoff_s <= found.wake_s < 0.1


def test_a_bad_forced_algorithm_is_named_before_any_set_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from shmtrain.fabric.allreduce.pipeline import PipelinedAllreduce

    monkeypatch.setenv("SHMTRAIN_ALLREDUCE_ALGORITHM", "ring")
    with pytest.raises(ValueError, match=r"SHMTRAIN_ALLREDUCE_ALGORITHM='ring': choose one of all-read, split, "
                                         r"two-level \(or unset it"):
        PipelinedAllreduce(None)  # refused before the host is touched
    with pytest.raises(ValueError, match=r"split=True and algorithm='all-read' disagree"):
        PipelinedAllreduce(None, split=True, algorithm="all-read")


def test_a_bound_rank_measures_the_host_in_a_fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """After --bind core pinned rank 0 (and its torch threads) to one core, the model must
    still describe every core the ranks share: it is measured in a process that may use them."""
    host = machine_model.host_cores()
    if len(host) < 2:
        pytest.skip("one core: nothing to narrow")
    monkeypatch.setattr(machine_model, "allowed_cores", lambda: host[:1])  # as if bound to one core
    monkeypatch.setattr(machine_model, "measure", lambda: pytest.fail("measured on the narrowed cores"))
    found = machine_model.measure_host()
    assert found.cores == host
