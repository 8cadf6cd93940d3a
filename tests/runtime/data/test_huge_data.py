"""A data set's length costs neither memory nor start-up: the held-out split of a lazy
``--data module:callable`` data set and every worker's shards are computed per index
(``runtime/data/permutation.py``), and the launcher's memory check counts what opening
the data cost it."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from shmtrain.runtime.config import TrainConfig
from shmtrain.runtime.data.permutation import PermutedRange, permute
from shmtrain.runtime.data.tensors import EAGER_LIMIT, ShardSampler
from shmtrain.runtime.data.user_data import split_user_data
from shmtrain.runtime.launch import preflight
from support.data_sets import Huge


def resident() -> int:
    return preflight.resident_bytes()


@pytest.mark.parametrize("size", [4 * 10**6, 10**9])
def test_a_huge_lazy_data_set_is_split_and_sharded_in_constant_memory_and_time(size: int) -> None:
    before, start = resident(), time.perf_counter()
    train, val = split_user_data("support.data_sets:huge", Huge(size), None)
    samplers = [ShardSampler(len(train), 64, 4, rank, seed=1) for rank in range(4)]
    batches = [s.indices(step) for s in samplers for step in (0, 1, 10**5)]
    items = [train[0], train[len(train) - 1], val[0], val[len(val) - 1]]
    grown, took = resident() - before, time.perf_counter() - start
    assert len(val) == size // 5 and len(train) == size - size // 5
    assert all(len(b) == 64 and int(b.min()) >= 0 and int(b.max()) < len(train) for b in batches)
    assert all(x.shape == (2,) for x, _ in items)
    assert grown < 16 << 20, f"{grown / 1e6:.0f} MB for {size} items"  # randperm().tolist(): 36 B/item
    assert took < 5.0, f"{took:.1f} s for {size} items"


def test_the_held_out_split_is_disjoint_from_training_and_covers_the_set() -> None:
    size = 1000
    train, val = split_user_data("support.data_sets:huge", Huge(size), 0.3)
    seen = list(train.indices) + list(val.indices)
    assert len(val) == 300 and sorted(seen) == list(range(size))
    assert list(PermutedRange(size, 0)[:5]) != list(range(5))  # shuffled
    assert list(PermutedRange(size, 0)) == permute(np.arange(size), size, 0).tolist()


def test_large_sets_keep_the_exact_sharding() -> None:
    size, batch, world = EAGER_LIMIT + 4099, 2048, 2  # computed per index, not randperm
    steps = size // (batch * world)
    single = ShardSampler(size, batch * world, 1, 0, seed=5)
    ranks = [ShardSampler(size, batch, world, r, seed=5) for r in range(world)]
    epoch = []
    for step in range(steps):
        union = torch.cat([ranks[r].indices(step) for r in range(world)])
        assert torch.equal(union, single.indices(step)), step  # the workers' batches = one process's
        epoch.append(union)
    seen = torch.cat(epoch)
    assert len(torch.unique(seen)) == len(seen) == steps * batch * world  # no sample twice in an epoch
    assert not torch.equal(single.indices(0), single.indices(steps))  # a new permutation per epoch


def test_small_sets_keep_their_permutation() -> None:
    gen = torch.Generator().manual_seed(3 * 1_000_003 + 1)
    assert torch.equal(ShardSampler(100, 10, 2, 1, seed=3).indices(5 + 2), torch.randperm(100, generator=gen)[50:60])


def test_the_memory_check_counts_what_opening_the_data_costs_the_launcher() -> None:
    config = TrainConfig(data="support.data_sets:heavy", data_args="mb=96", model="mlp", batch_size=8, workers=2)
    facts = preflight.check_data(config)
    assert facts.open_bytes >= 90 << 20, facts
    light = preflight.DataFacts(facts.train_samples, facts.input_shape, facts.num_classes, in_memory=False)
    private, _ = preflight.estimate_bytes(config, facts, 2)
    without, _ = preflight.estimate_bytes(config, light, 2)
    assert private - without >= 3 * (90 << 20)  # two workers open it, and the launcher holds it


def test_an_evaluation_reads_at_most_eval_samples_items_spread_over_the_split() -> None:
    from shmtrain.runtime.data.loader import HeldOut

    class Source:  # the part of a DataSource HeldOut reads
        tensors = None
        num_classes, name = 2, "support.data_sets:huge"

        def __init__(self, val) -> None:
            self.val, self.val_samples = val, len(val)

    _, val = split_user_data("support.data_sets:huge", Huge(2 * 10**7), None)
    held = HeldOut(Source(val), limit=1000)
    try:
        seen = torch.cat([x[:, 0] for x, _ in held])
    finally:
        held.close()
    assert len(held) == 1000 and len(seen) == 1000  # of 4 million held out
    everything = HeldOut(Source(val), limit=0)
    assert len(everything) == 4 * 10**6
    everything.close()


@pytest.mark.slow  # ~35 s: the bounded final evaluation of 50,000 lazy items on this VM
@pytest.mark.timeout(150)
def test_a_huge_lazy_data_set_trains_and_ends_without_evaluating_its_whole_split(tmp_path) -> None:
    from conftest import run_main

    start = time.monotonic()
    done = run_main("train", "--data", "support.data_sets:huge", "--data-args", "size=20000000", "--model", "mlp",
                    "--workers", "2", "--iterations", "3", "--loader-workers", "0", "--no-progress",
                    "--out", str(tmp_path / "run"))
    took = time.monotonic() - start
    assert done.returncode == 0, done.stderr
    assert took < 90, f"{took:.0f} s"  # the whole split of 4e6 items did not end within 120 s
