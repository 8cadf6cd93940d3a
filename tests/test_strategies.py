"""The strategy interface: registry, and what each strategy declares about the job."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from shmtrain import strategies


@pytest.mark.parametrize("name", ["gpi", "cpu_acc", "seasgd", "easgd", "downpour"])
def test_one_host_strategies_refuse_a_job_across_hosts(name: str) -> None:
    cls = strategies.get(name)
    assert cls.one_host_reason
    model = nn.Linear(2, 2)
    ctx = SimpleNamespace(num_nodes=2)
    with pytest.raises(ValueError, match=rf"--strategy {name} runs on one host \(2 hosts"):
        cls(cls.Config(), ctx, model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_registry_rejects_a_duplicate_name() -> None:
    class Again(strategies.Strategy):
        name = "ssgd"

    with pytest.raises(ValueError, match="already registered"):
        strategies.register(Again)
    with pytest.raises(ValueError, match="--strategy 'nope' is unknown"):
        strategies.get("nope")
