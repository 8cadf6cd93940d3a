"""The strategy interface: registry, and what each strategy declares about the job."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from shmtrain import strategies
from shmtrain.runtime.launch.launcher import launch


# hsgd lays out its groups from the job before the base constructor checks the device
@pytest.mark.parametrize("name", sorted(set(strategies.registry()) - {"hsgd"}))
def test_every_strategy_spans_hosts(name: str) -> None:
    # seasgd/easgd/downpour/hsgd: a memory server holds the global weights; gpi and
    # cpu_acc: the hosts' leaders sum each layer (HostCombiner); the rest over gloo
    cls = strategies.get(name)
    assert cls.hosts_reason(cls.Config()) is None


def test_a_one_host_transport_refuses_a_job_across_hosts() -> None:
    class OneHost(strategies.get("single")):
        name = "onehost"

        @classmethod
        def hosts_reason(cls, config):
            return "its transport is one host's shared memory"

    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"--strategy onehost runs on one host \(2 hosts in this job\): its"):
        OneHost(OneHost.Config(), SimpleNamespace(num_nodes=2), model, torch.optim.SGD(model.parameters(), lr=0.1))


# hsgd lays out its groups from the job before the base constructor checks the device
@pytest.mark.parametrize("name", sorted(set(strategies.registry()) - {"hsgd"}))
def test_strategies_refuse_parameters_on_a_device_they_do_not_stage(name: str) -> None:
    supported = "cpu, cuda"  # every strategy stages through host memory (strategies/layout/staging.py)
    cls = strategies.get(name)
    model = nn.Linear(2, 2, device="meta")
    ctx = SimpleNamespace(num_nodes=1)
    with pytest.raises(ValueError, match=rf"--strategy {name} supports parameters on {supported}, "
                                         r"but the model has parameters on meta"):
        cls(cls.Config(), ctx, model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_registry_rejects_a_duplicate_name() -> None:
    class Again(strategies.Strategy):
        name = "ssgd"

    with pytest.raises(ValueError, match="already registered"):
        strategies.register(Again)
    with pytest.raises(ValueError, match="--strategy 'nope' is unknown"):
        strategies.get("nope")


def resumed_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    """Train 3 steps after restoring ``iteration`` (a resumed run): the fabric's counters
    start at 0 again, so the exchange protocol must number its rounds by ``steps``."""
    from shmtrain.parallel.data_parallel import DataParallel
    from support.equivalence import STRATEGIES, Mixed, relative_errors, sgd

    strategy, options = STRATEGIES[payload["mode"]]
    world, batch = ctx.world_size, 4
    torch.manual_seed(0)
    model, reference = Mixed(), Mixed()
    reference.load_state_dict(model.state_dict())
    opt, ref_opt = sgd(model), sgd(reference)
    dp = DataParallel(model, opt, strategy, ctx=ctx, **options)
    dp.strategy.load_state_dict({"iteration": 7})
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for _ in range(3):
        x, y = (
            torch.randn((world * batch, 3, 8, 8), generator=gen),
            torch.randint(0, 5, (world * batch,), generator=gen),
        )
        mine = slice(ctx.rank * batch, (ctx.rank + 1) * batch)
        dp.zero_grad()
        loss_fn(dp(x[mine]), y[mine]).backward()
        dp.step()
        ref_opt.zero_grad()
        loss_fn(reference(x), y).backward()
        ref_opt.step()
        worst = max(worst, max(relative_errors(model, reference).values()))
    out = {"iteration": dp.strategy.iteration, "steps": dp.strategy.steps, "worst": worst}
    dp.close()
    return out


@pytest.mark.parametrize("mode", ["gpi", "cpu_acc"])
def test_exchange_protocol_survives_a_restored_iteration(mode: str) -> None:
    results = launch("strategies.test_registry:resumed_worker", 2, {"mode": mode}, timeout=60)
    for result in results:
        assert (result["iteration"], result["steps"]) == (10, 3)
        assert result["worst"] < 1e-5, f"{mode}: relative error {result['worst']:.2e}"
