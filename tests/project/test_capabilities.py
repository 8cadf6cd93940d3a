"""Every capability ID of ../shared/papers/README.md points to code, a test and a
reproduction (docs/capabilities.md); and DATA / IO, which no other test file covers
by itself: shards without duplication, prefetch in step order."""

from __future__ import annotations

import re

import pytest
import torch

from shmtrain.reproduce.core import registry
from shmtrain.runtime.data.tensors import Prefetcher, ShardSampler
from support.paths import ROOT

PAPERS = ROOT.parent / "shared" / "papers" / "README.md"


def rows() -> dict[str, list[str]]:
    table = {}
    for line in (ROOT / "docs" / "capabilities.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("ID", "---"):
            table[cells[0]] = cells[1:]
    return table


@pytest.mark.skipif(not PAPERS.exists(), reason="../shared/papers/README.md is not beside the checkout")
def test_every_id_of_the_papers_has_a_row() -> None:
    ids = set(re.findall(r"^\| ([A-Z][A-Z0-9-]+(?: / [A-Z][A-Z0-9-]+)?) \|", PAPERS.read_text(), re.M)) - {"ID"}
    assert ids and ids <= set(rows()), sorted(ids - set(rows()))


def test_every_file_and_reproduction_named_exists() -> None:
    names = set(registry())
    for capability, (code, test, reproduction) in rows().items():
        for path in re.findall(r"`([\w./-]+\.(?:py|md))`", code + " " + test + " " + reproduction):
            assert (ROOT / path).exists(), (capability, path)
        assert re.search(r"`tests/(?:\w+/)*test_\w+\.py`", test), capability
        for name in re.findall(r"`([a-z]+-[\w.-]+)`", reproduction):
            if not name.endswith(".md"):
                assert name in names, (capability, name)


def test_shards_cover_each_epoch_once_without_duplication() -> None:
    world, batch, size = 3, 4, 50
    samplers = [ShardSampler(size, batch, world, rank, seed=7) for rank in range(world)]
    steps = samplers[0].steps_per_epoch
    assert steps == size // (batch * world)
    for epoch in range(2):
        seen = torch.cat([s.indices(epoch * steps + t) for t in range(steps) for s in samplers])
        assert len(seen) == len(set(seen.tolist())) == steps * batch * world  # no duplicate
    assert not torch.equal(samplers[0].indices(0), samplers[0].indices(steps))  # reshuffled per epoch


def test_prefetch_delivers_the_sampler_batches_in_step_order_from_a_start() -> None:
    x, y = torch.arange(40.0).unsqueeze(1), torch.arange(40)
    sampler = ShardSampler(40, 4, 2, 1, seed=0)
    prefetch = Prefetcher(x, y, sampler, depth=10, start=3)
    try:
        for step in range(3, 9):
            bx, by = prefetch.next(timeout=10)
            assert torch.equal(by, sampler.indices(step)) and torch.equal(bx[:, 0], by.float())
    finally:
        prefetch.close()
