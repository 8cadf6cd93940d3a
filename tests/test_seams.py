"""The transport seam holds: a strategy gets every exchange object from its
:class:`~shmtrain.fabric.transports.Transports`, never builds one, never reaches into a
private name of the fabric; and a strategy runs on in-process peers through a fake one."""

from __future__ import annotations

import ast
import threading
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

import shmtrain.strategies
from shmtrain.strategies.base import build_config
from shmtrain.strategies.ssgd import SSGD

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
                       "    self.group_host.allocate('w', 64)\n"
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
                     "uses group_host.allocate instead of the transports' (line 2)"], problems


class _PeerAllreduce:
    """One peer's end of an in-process mean allreduce among threads (the
    :class:`~shmtrain.fabric.transports.Allreduce` protocol): slots per peer and parity,
    one shared result per parity, a barrier either side of the sum."""

    def __init__(self, world: _World, rank: int) -> None:
        self.world, self.rank, self.count = world, rank, 0

    def input(self, step: int | None = None) -> torch.Tensor:
        return self.world.slots[self.rank][(self.count + 1 if step is None else step) % 2]

    def result(self, step: int | None = None) -> torch.Tensor:
        return self.world.results[(self.count if step is None else step) % 2]

    def __call__(self) -> torch.Tensor:
        self.count += 1
        self.world.barrier.wait()
        if self.rank == 0:
            parity = self.count % 2
            self.world.results[parity].copy_(torch.stack([slots[parity] for slots in self.world.slots]).mean(0))
        self.world.barrier.wait()
        return self.result()

    def close(self) -> None:
        pass


class _World:
    def __init__(self, peers: int, numel: int) -> None:
        self.barrier = threading.Barrier(peers, timeout=30)
        self.slots = [[torch.zeros(numel), torch.zeros(numel)] for _ in range(peers)]
        self.results = [torch.zeros(numel), torch.zeros(numel)]


class FakeTransports:
    """A :class:`~shmtrain.fabric.transports.Transports` whose allreduce runs among
    threads of this process (hivemind tests its AllReduceRunner on in-process peers the
    same way); any other factory is refused, so the test shows what ssgd asks for."""

    def __init__(self, world: _World, rank: int) -> None:
        self.world, self.rank = world, rank
        self.asked: list[str] = []

    def allreduce(self, name: str, numel: int, dtype: torch.dtype = torch.float32, op: str = "mean", *,
                  tag: str = "grads") -> _PeerAllreduce:
        self.asked.append(f"allreduce {name} {op}")
        return _PeerAllreduce(self.world, self.rank)

    def __getattr__(self, name: str):
        raise AssertionError(f"the strategy asked the fake transports for {name}")


def train_steps(strategy, model: nn.Module, xs: torch.Tensor, ys: torch.Tensor, rank: int,
                loss=nn.functional.cross_entropy) -> None:
    """The loop of an in-process peer: ``xs[step, rank]`` for every step, through the
    strategy's hooks in the order ``DataParallel`` calls them."""
    for step in range(xs.shape[0]):
        strategy.zero_grad()
        strategy.before_forward()
        loss(model(xs[step, rank]), ys[step, rank]).backward()
        strategy.after_backward()
        strategy.apply_update()
        strategy.after_update()


def on_threads(peers: int, work, barrier: threading.Barrier) -> None:
    """Run ``work(rank)`` on ``peers`` threads (in-process peers); the first error aborts
    ``barrier`` so no peer waits for it, and every error fails the test."""
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            work(rank)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(peers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def test_ssgd_on_in_process_peers_through_a_fake_transports_equals_single_process_sgd() -> None:
    peers, steps, batch = 3, 5, 4
    torch.manual_seed(1)
    xs, ys = torch.randn(steps, peers, batch, 6), torch.randint(0, 3, (steps, peers, batch))
    numel = sum(p.numel() for p in _net().parameters())
    world = _World(peers, numel)
    config = build_config("ssgd", {})
    finals: list[torch.Tensor | None] = [None] * peers
    asked: list[list[str]] = [[] for _ in range(peers)]

    # built here, one after another: torch's RNG is global, and threads seeding it at once
    # would draw each other's numbers (the peers would start from different weights)
    models = [_net() for _ in range(peers)]

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
    reference = _net()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):  # the union batch: the mean of the peers' equal-sized losses
        opt.zero_grad()
        nn.functional.cross_entropy(reference(xs[step].flatten(0, 1)), ys[step].flatten()).backward()
        opt.step()
    expected = torch.cat([p.detach().flatten() for p in reference.parameters()])
    for rank in range(peers):
        assert asked[rank] == ["allreduce shm mean"]
        assert torch.allclose(finals[rank], expected, rtol=1e-5, atol=1e-6), rank
    assert finals[0] is not None and not torch.equal(finals[0],
                                                     torch.cat([p.detach().flatten() for p in _net().parameters()]))
