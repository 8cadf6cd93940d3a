"""In-process peers on one host: threads of this process that train a strategy through a
fake :class:`~shmtrain.fabric.transports.Transports` (no worker process, no shared
memory), whose allreduce averages among the threads and whose other factories are refused
(a strategy that grew a new dependency says so)."""

from __future__ import annotations

import threading

import torch
from torch import nn


class PeerAllreduce:
    """One peer's end of an in-process mean allreduce among threads (the
    :class:`~shmtrain.fabric.transports.Allreduce` protocol): slots per peer and parity,
    one shared result per parity, a barrier either side of the sum."""

    def __init__(self, world: World, rank: int) -> None:
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


class World:
    """What the peers of one allreduce share: a barrier, two slots per peer, two results."""

    def __init__(self, peers: int, numel: int) -> None:
        self.barrier = threading.Barrier(peers, timeout=30)
        self.slots = [[torch.zeros(numel), torch.zeros(numel)] for _ in range(peers)]
        self.results = [torch.zeros(numel), torch.zeros(numel)]


class FakeTransports:
    """A :class:`~shmtrain.fabric.transports.Transports` whose allreduce runs among
    threads of this process (hivemind tests its AllReduceRunner on in-process peers the
    same way); any other factory is refused, so the test shows what ssgd asks for."""

    def __init__(self, world: World, rank: int) -> None:
        self.world, self.rank = world, rank
        self.asked: list[str] = []

    def allreduce(self, name: str, numel: int, dtype: torch.dtype = torch.float32, op: str = "mean", *,
                  tag: str = "grads") -> PeerAllreduce:
        self.asked.append(f"allreduce {name} {op}")
        return PeerAllreduce(self.world, self.rank)

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


def small_net() -> nn.Module:
    """The peers' model: 6 inputs, 8 tanh units, 3 classes, seeded (the same on every peer)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

