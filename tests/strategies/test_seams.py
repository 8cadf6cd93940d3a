"""The transport seam holds: a strategy gets every exchange object from its
:class:`~shmtrain.fabric.transports.Transports`, never builds one, never reaches into a
private name of the fabric; and a strategy runs on in-process peers through a fake one."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

import shmtrain.strategies
from shmtrain.strategies.base import build_config
from shmtrain.strategies.ssgd import SSGD
from support.fake_transports import FakeTransports, World, on_threads, small_net, train_steps

STRATEGIES = Path(shmtrain.strategies.__file__).parent
#: fabric classes a strategy may build: value types with no peer behind them (a flat view
#: of the parameters; the device copies, made in the base's ``make_staging``; the seam)
VALUE_TYPES = {"FlatLayout", "HostStaging", "Transports"}
#: calls that build transports: making process groups
BUILDERS = {("dist", "new_group"), ("dist", "all_reduce"), ("dist", "all_gather_object")}
#: the host's services (a host's or a group's segments, control-block words, barriers): a
#: strategy reaches them through its transports only, never on the host or a group itself
HOST_SERVICES = {"allocate", "control", "barrier", "channel"}


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    fabric_names: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shmtrain.fabric"):
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"imports the private {node.module}.{alias.name}")
                fabric_names.add(alias.asname or alias.name)
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if any(n == "torch.distributed" for n in names):
                found.append("imports torch.distributed")
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in fabric_names and func.id[:1].isupper() \
                    and not func.id.endswith(("Error", "Failure", "Timeout")) \
                    and func.id not in VALUE_TYPES:
                found.append(f"builds {func.id} (line {node.lineno})")
            if isinstance(func, ast.Attribute):
                owner = _name(func.value)
                if (owner, func.attr) in BUILDERS:
                    found.append(f"calls {owner}.{func.attr} (line {node.lineno})")
        if isinstance(node, ast.Attribute):
            owner = _name(node.value)
            if node.attr == "host" and owner == "ctx":
                found.append(f"reaches ctx.host (line {node.lineno})")
            if node.attr in HOST_SERVICES and owner != "transports":
                found.append(f"uses {owner}.{node.attr} instead of the transports' (line {node.lineno})")
    return [f"{path.relative_to(STRATEGIES.parent)}: {v}" for v in found]


def _name(node: ast.expr) -> str:
    """The last name of ``a.b.c`` (``c``), of ``a`` (``a``); "" for anything else."""
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def test_no_strategy_builds_a_fabric_object_or_imports_a_private_name() -> None:
    modules = sorted(STRATEGIES.rglob("*.py"))
    assert len(modules) > 10
    problems = [v for path in modules for v in _violations(path)]
    assert not problems, "\n".join(problems)


def test_the_check_catches_a_strategy_that_builds_its_own_transport(tmp_path: Path) -> None:
    bad = STRATEGIES / "_seam_probe.py"
    try:
        bad.write_text("from shmtrain.fabric.exchanges.onesided import OneSidedWindow\n"
                       "from shmtrain.fabric.shm.control import _alive\n"
                       "import torch.distributed as dist\n"
                       "def f(ctx):\n    ctx.host.allocate('x', 1)\n    dist.new_group()\n"
                       "    return OneSidedWindow(ctx.host, 1, 1)\n")
        problems = _violations(bad)
    finally:
        bad.unlink()
    assert len(problems) == 7, problems  # and ctx.host twice (the allocate, the window)


def test_the_check_catches_a_strategy_that_reaches_the_host_or_its_group_directly() -> None:
    bad = STRATEGIES / "_seam_probe.py"
    try:
        bad.write_text("def f(self, ctx, gh):\n"
                       "    self.subgroup.allocate('w', 64)\n"
                       "    gh.control.post(0, 0, 1)\n"
                       "    control = self.ctx.host\n"
                       "    self.transports.barrier('fine')\n"
                       "    self.transports.control(gh).post(0, 0, 1)\n"
                       "    return control.barrier('x')\n")
        problems = _violations(bad)
    finally:
        bad.unlink()
    found = sorted(p.split(": ", 1)[1] for p in problems)
    assert found == ["reaches ctx.host (line 4)", "uses control.barrier instead of the transports' (line 7)",
                     "uses gh.control instead of the transports' (line 3)",
                     "uses subgroup.allocate instead of the transports' (line 2)"], problems


def test_ssgd_on_in_process_peers_through_a_fake_transports_equals_single_process_sgd() -> None:
    peers, steps, batch = 3, 5, 4
    torch.manual_seed(1)
    xs, ys = torch.randn(steps, peers, batch, 6), torch.randint(0, 3, (steps, peers, batch))
    numel = sum(p.numel() for p in small_net().parameters())
    world = World(peers, numel)
    config = build_config("ssgd", {})
    finals: list[torch.Tensor | None] = [None] * peers
    asked: list[list[str]] = [[] for _ in range(peers)]

    # built here, one after another: torch's RNG is global, and threads seeding it at once
    # would draw each other's numbers (the peers would start from different weights)
    models = [small_net() for _ in range(peers)]

    def peer(rank: int) -> None:
        model = models[rank]
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ctx = SimpleNamespace(rank=rank, world_size=peers, num_nodes=1)
        transports = FakeTransports(world, rank)
        strategy = SSGD(config, ctx, model, opt, transports=transports)
        train_steps(strategy, model, xs, ys, rank)
        finals[rank] = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
        asked[rank] = transports.asked
        strategy.finish()

    on_threads(peers, peer, world.barrier)
    reference = small_net()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):  # the union batch: the mean of the peers' equal-sized losses
        opt.zero_grad()
        nn.functional.cross_entropy(reference(xs[step].flatten(0, 1)), ys[step].flatten()).backward()
        opt.step()
    expected = torch.cat([p.detach().flatten() for p in reference.parameters()])
    for rank in range(peers):
        assert asked[rank] == ["allreduce shm mean"]
        assert torch.allclose(finals[rank], expected, rtol=1e-5, atol=1e-6), rank
    start = torch.cat([p.detach().flatten() for p in small_net().parameters()])
    assert finals[0] is not None and not torch.equal(finals[0], start)
