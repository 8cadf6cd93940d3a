"""docs/strategies.md's worked example is a working strategy: its code block, run on
in-process peers through the fake Transports of tests/support/fake_transports.py, gives the
weights of the same local SGD computed by hand."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from support.fake_transports import FakeTransports, World, on_threads, train_steps
from support.paths import ROOT

DOC = ROOT / "docs" / "strategies.md"


def _example() -> dict:
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 - the doc's own example
    return namespace


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))


def test_the_documented_strategy_averages_every_period() -> None:
    example = _example()
    peers, steps, period = 3, 6, 3
    torch.manual_seed(2)
    xs, ys = torch.randn(steps, peers, 4, 5), torch.randint(0, 2, (steps, peers, 4))
    world = World(peers, sum(p.numel() for p in _net().parameters()))
    models = [_net() for _ in range(peers)]
    finals: list[list[torch.Tensor]] = [[] for _ in range(peers)]

    def peer(rank: int) -> None:
        model = models[rank]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ctx = SimpleNamespace(rank=rank, world_size=peers, num_nodes=1)
        strategy = example["ModelAverage"](example["AverageConfig"](period=period), ctx, model, opt,
                                           transports=FakeTransports(world, rank))
        train_steps(strategy, model, xs, ys, rank)
        finals[rank] = [p.detach().clone() for p in model.parameters()]
        strategy.finish()

    on_threads(peers, peer, world.barrier)
    # by hand: each replica steps alone; every `period` steps all take the mean
    replicas = [_net() for _ in range(peers)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in replicas]
    for step in range(steps):
        for r, (m, opt) in enumerate(zip(replicas, opts, strict=True)):
            opt.zero_grad()
            nn.functional.cross_entropy(m(xs[step, r]), ys[step, r]).backward()
            opt.step()
        if (step + 1) % period == 0:
            with torch.no_grad():
                for params in zip(*(m.parameters() for m in replicas), strict=True):
                    mean = torch.stack(params).mean(0)
                    for p in params:
                        p.copy_(mean)
    for rank in range(peers):
        for got, want in zip(finals[rank], replicas[rank].parameters(), strict=True):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), rank
    assert not torch.equal(finals[0][0], _net()[0].weight)


def test_the_documented_config_refuses_a_bad_period() -> None:
    with pytest.raises(ValueError, match="--period 0"):
        _example()["AverageConfig"](period=0)
