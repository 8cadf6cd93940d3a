"""In-process peers on several hosts: threads of this process that train a strategy
through a fake ``Transports`` that also plays the hosts. ``allreduce`` averages over
every peer and counts the bytes a host's leader sends to the other hosts (the
hierarchical allreduce's only link traffic: the host's reduced buffer,
``fabric/allreduce/shared.py``), ``group_allreduce`` averages inside a host, and
``compressed_allreduce`` builds fabric's real CompressedAllreduce from in-process pieces
(DiLoCo's tests run on them)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from shmtrain.strategies.base import build_config
from shmtrain.strategies.plan import plan
from shmtrain.timing import PhaseTimer
from support.fake_transports import train_steps
from support.reference import flat_params

IN, OUT, BATCH = 6, 3, 4


class Exchange:
    """The state shared by the peers of one allreduce (a tag): slots, results, a barrier."""

    def __init__(self, members: list[int], numel: int, dtype: torch.dtype) -> None:
        self.members = members
        self.barrier = threading.Barrier(len(members), timeout=30)
        self.slots = {r: [torch.zeros(numel, dtype=dtype), torch.zeros(numel, dtype=dtype)] for r in members}
        self.results = [torch.zeros(numel, dtype=dtype), torch.zeros(numel, dtype=dtype)]


class PeerAllreduce:
    """One peer's end of an in-process mean allreduce (the ``Allreduce`` protocol)."""

    def __init__(self, world: World, exchange: Exchange, rank: int, across: bool) -> None:
        self.world, self.exchange, self.rank, self.across, self.count = world, exchange, rank, across, 0

    def input(self, step: int | None = None) -> torch.Tensor:
        return self.exchange.slots[self.rank][(self.count + 1 if step is None else step) % 2]

    def result(self, step: int | None = None) -> torch.Tensor:
        return self.exchange.results[(self.count if step is None else step) % 2]

    def __call__(self) -> torch.Tensor:
        self.count += 1
        parity, ex = self.count % 2, self.exchange
        ex.barrier.wait()
        if self.rank == ex.members[0]:
            stacked = torch.stack([ex.slots[r][parity].float() for r in ex.members])
            ex.results[parity].copy_(stacked.mean(0))
        if self.across and self.world.is_leader(self.rank) and self.world.hosts > 1:
            self.world.count_across(self.rank, self.input(self.count).nbytes)
        ex.barrier.wait()
        return self.result()

    def close(self) -> None:
        pass


class World:
    """Peers on ``hosts`` hosts (consecutive ranks per host) and the bytes each sent across."""

    def __init__(self, peers: int, hosts: int = 1) -> None:
        self.peers, self.hosts, self.local = peers, hosts, peers // hosts
        self.lock = threading.Lock()
        self.exchanges: dict[tuple[str, int], Exchange] = {}
        self.bytes_across = [0] * peers
        self.errors: list[BaseException] = []

    def is_leader(self, rank: int) -> bool:
        return rank % self.local == 0

    def count_across(self, rank: int, nbytes: int) -> None:
        with self.lock:
            self.bytes_across[rank] += nbytes

    def exchange(self, tag: str, group: int, members: list[int], numel: int, dtype: torch.dtype) -> Exchange:
        with self.lock:
            key = (tag, group)
            if key not in self.exchanges:
                self.exchanges[key] = Exchange(members, numel, dtype)
            return self.exchanges[key]

    def abort(self) -> None:
        with self.lock:
            for ex in self.exchanges.values():
                ex.barrier.abort()


class Board:
    """A host's board in memory: the leader writes the tensor, a barrier publishes it."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange

    def tensor(self) -> torch.Tensor:
        return self.exchange.results[0]

    def post(self, step: int) -> None:
        self.exchange.barrier.wait()

    wait = post

    def close(self) -> None:
        pass


class FakeTransports:
    """A ``Transports`` whose allreduces run among threads; any other factory is refused."""

    def __init__(self, world: World, rank: int) -> None:
        self.world, self.rank = world, rank

    def allreduce(self, name: str, numel: int, dtype: torch.dtype = torch.float32, op: str = "mean", *,
                  tag: str = "grads") -> PeerAllreduce:
        assert (name, op) == ("shm", "mean")
        exchange = self.world.exchange(tag, 0, list(range(self.world.peers)), numel, dtype)
        return PeerAllreduce(self.world, exchange, self.rank, across=True)

    def group_allreduce(self, group: int, numel: int, dtype: torch.dtype = torch.float32, op: str = "mean", *,
                        tag: str = "group") -> PeerAllreduce:
        local = self.world.local
        members = list(range(group * local, (group + 1) * local))
        exchange = self.world.exchange(tag, group, members, numel, dtype)
        return PeerAllreduce(self.world, exchange, self.rank, across=False)

    def host_allreduce(self, numel: int, dtype: torch.dtype = torch.float32, op: str = "mean", *,
                       tag: str = "host") -> PeerAllreduce:
        return self.group_allreduce(self.rank // self.world.local, numel, dtype, op, tag=tag)
    def compressed_allreduce(self, numel: int, spec, *, tag: str):
        """fabric's CompressedAllreduce on in-process pieces: the host's mean, a board
        (a tensor and a barrier per host) and the leaders' all-gather, which counts the
        payload each leader sends across."""
        from shmtrain.fabric.compress.allreduce import CompressedAllreduce

        world, host = self.world, self.rank // self.world.local
        members = list(range(host * world.local, (host + 1) * world.local))
        board = world.exchange(f"{tag}.board", host, members, numel, torch.float32)
        leader = world.is_leader(self.rank)
        gather = None
        if leader and world.hosts > 1:
            leaders = [h * world.local for h in range(world.hosts)]
            gathered = world.exchange(f"{tag}.gather", 0, leaders, 0, torch.uint8)

            def gather(payload: torch.Tensor) -> list[torch.Tensor]:
                gathered.slots[self.rank] = [payload.clone()]
                world.count_across(self.rank, payload.nbytes)
                gathered.barrier.wait()
                out = [gathered.slots[r][0].clone() for r in leaders]
                gathered.barrier.wait()
                return out

        return CompressedAllreduce(self.group_allreduce(host, numel, tag=f"{tag}.host"), Board(board), numel,
                                   spec, leader=leader, gather=gather)

    def __getattr__(self, name: str):
        raise AssertionError(f"the strategy asked the fake transports for {name}")


def peer_model() -> nn.Module:
    """The peers' model: IN inputs, 8 tanh units, OUT classes, seeded (the same on every peer)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 8), nn.Tanh(), nn.Linear(8, OUT))


def inner_sgd(model: nn.Module) -> torch.optim.Optimizer:
    """The inner optimizer of every peer (and of the references): SGD, momentum 0.9, weight decay 1e-3."""
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)


def peer_batches(steps: int, peers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``xs[step, peer]`` and ``ys[step, peer]``: each peer's batch of BATCH at every step (seeded)."""
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(steps, peers, BATCH, IN, generator=gen),
            torch.randint(0, OUT, (steps, peers, BATCH), generator=gen))


def run_peers(strategy: str, options: dict[str, Any], peers: int, steps: int, hosts: int = 1, *,
              finish: bool = True) -> dict[str, Any]:
    """Train ``steps`` iterations of ``strategy`` on ``peers`` threads over ``hosts`` fake
    hosts; every peer's final weights and the bytes each peer sent across hosts (with
    ``finish=False`` the engines are left open, their exchanges and state still there)."""
    xs, ys = peer_batches(steps, peers)
    config = build_config(strategy, options)
    planned = plan(strategy, config, peers, hosts)
    world = World(peers, hosts)
    models = [peer_model() for _ in range(peers)]  # built one after another: torch's RNG is global
    finals: list[torch.Tensor | None] = [None] * peers
    engines: list[Any] = [None] * peers

    def peer(rank: int) -> None:
        try:
            model = models[rank]
            ctx = SimpleNamespace(rank=rank, world_size=peers, num_nodes=hosts)
            engine = planned.build(ctx, model, inner_sgd(model), PhaseTimer(), transports=FakeTransports(world, rank))
            engines[rank] = engine
            train_steps(engine, model, xs, ys, rank)
            finals[rank] = flat_params(model)
            if finish:
                engine.finish()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            world.errors.append(exc)
            world.abort()

    threads = [threading.Thread(target=peer, args=(r,)) for r in range(peers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not world.errors, world.errors
    return {"finals": finals, "bytes_across": world.bytes_across, "engines": engines, "class": planned.strategy}

