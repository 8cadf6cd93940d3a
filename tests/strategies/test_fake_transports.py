"""Strategies on in-process peers (threads of this process) through a fake
:class:`~shmtrain.fabric.transports.Transports`: no worker process, no shared memory.
Each test checks a strategy's weights against the same method computed by hand here, and
the transports it asked for (the fake refuses any other factory, so a strategy that grew
a new dependency says so). Seven of the twelve registered strategies run this way here:
nocomm, single, ps_grad, ps_weight, diloco, ssgd (--overlap here, plain in
``tests/strategies/test_seams.py``) and cpu_acc."""

from __future__ import annotations

import ctypes
import mmap
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from shmtrain import strategies
from shmtrain.fabric.exchanges.accumulator import SharedAccumulator
from shmtrain.strategies.base import build_config
from support.fake_transports import FakeTransports, on_threads, small_net, train_steps

PEERS, STEPS, BATCH, LR, MOMENTUM = 3, 5, 4, 0.1, 0.9


class Peers:
    """What the peers share: one barrier, and the buffers of each exchange by its tag
    (made by the first peer that asks)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=30)
        self._lock = threading.Lock()
        self._shared: dict[tuple[str, str], Any] = {}

    def shared(self, kind: str, tag: str, make: Callable[[], Any]) -> Any:
        with self._lock:
            if (kind, tag) not in self._shared:
                self._shared[kind, tag] = make()
            return self._shared[kind, tag]

    def sync(self, rank: int, on_first: Callable[[], object] | None = None) -> None:
        """Every peer arrives; rank 0 runs ``on_first`` while the others wait; all leave."""
        self.barrier.wait()
        if rank == 0 and on_first is not None:
            on_first()
        self.barrier.wait()


def _mean(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.float() for t in tensors]).mean(0)


class TaggedAllreduce:
    """A mean allreduce among the peers with the real one's slot numbering: ``input()``
    is the next call's slot, ``result()`` the last call's; one pair of slots per peer and
    one pair of results per tag."""

    def __init__(self, peers: Peers, rank: int, tag: str, numel: int, dtype: torch.dtype) -> None:
        self.peers, self.rank, self.count = peers, rank, 0
        self.slots, self.results = peers.shared("allreduce", tag, lambda: (
            [[torch.zeros(numel, dtype=dtype) for _ in range(2)] for _ in range(peers.size)],
            [torch.zeros(numel, dtype=dtype) for _ in range(2)]))

    def input(self, step: int | None = None) -> torch.Tensor:
        return self.slots[self.rank][(self.count + 1 if step is None else step) % 2]

    def result(self, step: int | None = None) -> torch.Tensor:
        return self.results[(self.count if step is None else step) % 2]

    def __call__(self) -> torch.Tensor:
        self.count += 1
        parity = self.count % 2
        self.peers.sync(self.rank, lambda: self.results[parity].copy_(_mean([s[parity] for s in self.slots])))
        return self.result()

    def close(self) -> None:
        pass


def _untimed(name: str) -> AbstractContextManager[object]:  # noqa: ARG001 - a Phase
    return nullcontext()


class FakeStar:
    """The parameter server's star among the peers (``StarExchange``), rank 0 the server,
    each peer's ``mine`` and ``server`` private as in the gloo star."""

    def __init__(self, peers: Peers, rank: int, tag: str, numel: int, dtype: torch.dtype,
                 init: torch.Tensor) -> None:
        self.peers, self.rank, self.is_server = peers, rank, rank == 0
        self.mine = torch.zeros(numel, dtype=dtype)
        self.server = torch.empty(numel, dtype=dtype)
        self.ends: list[FakeStar | None] = peers.shared("star", tag, lambda: [None] * peers.size)
        self.ends[rank] = self
        self._init = init
        peers.barrier.wait()
        self.server.copy_(self.ends[0]._init)  # rank 0's initial weights, everywhere
        peers.barrier.wait()

    def gather_mean(self, into: torch.Tensor, phase=_untimed) -> None:
        with phase("gather"):
            self.peers.barrier.wait()
        if self.is_server:
            with phase("average"):
                into.copy_(_mean([end.mine for end in self.ends]))
        self.peers.barrier.wait()

    def broadcast(self) -> None:
        self.peers.sync(self.rank)  # the server's buffer is final
        if not self.is_server:
            self.server.copy_(self.ends[0].server)
        self.peers.barrier.wait()

    def mean_to_all(self, phase=_untimed) -> None:
        self.gather_mean(self.server, phase)
        with phase("broadcast"):
            self.broadcast()
            self.mine.copy_(self.server)

    def set_server(self, values: torch.Tensor) -> None:
        self.peers.sync(self.rank, lambda: values is self.server or self.server.copy_(values))
        if not self.is_server:
            self.server.copy_(self.ends[0].server)
        self.peers.barrier.wait()

    def close(self) -> None:
        pass


class FakeBuckets:
    """A bucket reducer among the peers (``BucketReducer``): ``wait(step)`` averages the
    buckets each peer launched for ``step``, in launch order, and only those (a bucket a
    strategy forgot keeps stale numbers, which the weights then show)."""

    def __init__(self, peers: Peers, rank: int, numel: int, buckets: Sequence[tuple[int, int]],
                 dtype: torch.dtype, tag: str) -> None:
        self.peers, self.rank, self.buckets = peers, rank, list(buckets)
        self.inputs, self._result, self.launches = peers.shared("buckets", tag, lambda: (
            [torch.zeros(numel, dtype=dtype) for _ in range(peers.size)], torch.zeros(numel, dtype=dtype),
            [[] for _ in range(peers.size)]))

    def input(self) -> torch.Tensor:
        return self.inputs[self.rank]

    def result(self) -> torch.Tensor:
        return self._result

    def launch(self, bucket: int, step: int) -> None:
        self.launches[self.rank].append((step, bucket))

    def progress(self, block: bool = False) -> None:
        pass

    def wait(self, step: int) -> None:
        def reduce() -> None:
            orders = [[b for s, b in launched if s == step] for launched in self.launches]
            assert all(order == orders[0] for order in orders), orders  # every peer the same sequence
            for b in orders[0]:
                lo, hi = self.buckets[b]
                self._result[lo:hi] = _mean([t[lo:hi] for t in self.inputs])

        self.peers.sync(self.rank, reduce)

    def close(self) -> None:
        pass


class AnonymousSegment:
    """Private memory with a segment's interface (``buffer``, ``address``, ``tensor``):
    the peers are threads, so one mapping is shared by all of them."""

    def __init__(self, nbytes: int) -> None:
        self.name, self.nbytes = "anonymous", nbytes
        self.buffer = mmap.mmap(-1, nbytes)

    def address(self, offset: int = 0) -> int:
        return ctypes.addressof(ctypes.c_char.from_buffer(self.buffer, offset))

    def tensor(self, dtype: torch.dtype, offset: int, numel: int) -> torch.Tensor:
        return torch.frombuffer(self.buffer, dtype=dtype, count=numel, offset=offset)


class ThreadHost:
    """One peer's view of the in-process "host": its local rank, and segments every peer
    maps (the first to ask makes each one and runs its ``init``), in asking order."""

    def __init__(self, peers: Peers, rank: int) -> None:
        self.peers, self.local_rank, self.local_world = peers, rank, peers.size
        self._made = 0

    def allocate(self, tag: str, nbytes: int, init: Callable[[Any], None] | None = None) -> AnonymousSegment:
        def make() -> AnonymousSegment:
            segment = AnonymousSegment(nbytes)
            if init is not None:
                init(segment)
            return segment

        self._made += 1
        return self.peers.shared("segment", f"{self._made}-{tag}", make)


class FakeControl:
    """The control block's words among the peers: one per channel and rank, written by
    its rank only; ``wait`` polls (no futex: the peers are threads)."""

    def __init__(self, peers: Peers) -> None:
        self.words: dict[tuple[int, int], int] = peers.shared("control", "words", dict)

    def post(self, channel: int, rank: int, value: int) -> None:
        self.words[channel, rank] = value

    def get(self, channel: int, rank: int) -> int:
        return self.words.get((channel, rank), 0)

    def wait(self, channel: int, ranks, target: int, *, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while any(self.get(channel, r) < target for r in ranks):
            assert time.monotonic() < deadline, f"{what}: timed out"
            time.sleep(0.0005)

    def check_peers(self, me: int, what: str) -> None:
        pass  # threads of one process: a failed peer aborts the barrier instead


class Fake(FakeTransports):
    """The fake of tests/support/fake_transports.py (any factory not named here is refused)
    with the exchanges above, by tag."""

    def __init__(self, peers: Peers, rank: int) -> None:
        super().__init__(peers, rank)  # type: ignore[arg-type]
        self._channels: list[str] = []

    def allreduce(self, name: str, numel: int, dtype: torch.dtype = torch.float32, op: str = "mean", *,
                  tag: str = "grads") -> TaggedAllreduce:
        self.asked.append(f"allreduce {name} {op} {tag}")
        assert op == "mean"
        return TaggedAllreduce(self.world, self.rank, tag, numel, dtype)

    def star(self, name: str, tag: str, numel: int, dtype: torch.dtype, init: torch.Tensor) -> FakeStar:
        self.asked.append(f"star {name} {tag}")
        return FakeStar(self.world, self.rank, tag, numel, dtype, init)

    def bucket_reducer(self, name: str, numel: int, buckets: Sequence[tuple[int, int]],
                       dtype: torch.dtype = torch.float32, op: str = "mean", *, tag: str = "buckets") -> FakeBuckets:
        self.asked.append(f"bucket_reducer {name} {op} {len(buckets)} buckets")
        assert op == "mean"
        return FakeBuckets(self.world, self.rank, numel, buckets, dtype, tag)

    def accumulator(self, numel: int, dtype: torch.dtype, layers: int, *, tag: str = "cpu_acc") -> SharedAccumulator:
        """The fabric's own accumulator (its layout, its critical counters), on memory the
        peer threads share."""
        self.asked.append(f"accumulator {layers} layers")
        return SharedAccumulator(ThreadHost(self.world, self.rank), numel, dtype, layers,  # type: ignore[arg-type]
                                 tag=tag)

    def channel(self, name: str) -> int:
        self.asked.append(f"channel {name}")
        if name not in self._channels:
            self._channels.append(name)
        return self._channels.index(name)

    def control(self, group: Any = None) -> FakeControl:
        assert group is None
        if "control" not in self.asked:
            self.asked.append("control")
        return FakeControl(self.world)

    def host_combiner(self, order, tensor, done, *, ready=None, name: str = "combiner") -> None:
        self.asked.append("host_combiner")
        return None  # one host: no other host's leader to combine with (as the real one)


def _data(peers: int, steps: int = STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(steps, peers, BATCH, 6), torch.randint(0, 3, (steps, peers, BATCH))


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def run_peers(name: str, options: dict[str, Any], peers: int, data) -> tuple[list[torch.Tensor], list[list[str]]]:
    """Train strategy ``name`` on ``peers`` threads through :class:`Fake`; every peer's
    flat weights after ``finish()``, and the transports each asked for."""
    xs, ys = data
    config = build_config(name, options)
    cls = strategies.get(name).implementation(config)
    world = Peers(peers)
    # built here, one after another: threads seeding torch's global RNG at once would
    # draw each other's numbers (the peers would start from different weights)
    models = [small_net() for _ in range(peers)]
    finals: list[torch.Tensor] = [torch.empty(0)] * peers
    asked: list[list[str]] = [[] for _ in range(peers)]

    def peer(rank: int) -> None:
        model = models[rank]
        ctx = SimpleNamespace(rank=rank, world_size=peers, num_nodes=1, node_rank=0, local_rank=rank,
                              local_world=peers, timeout=30.0)
        transports = Fake(world, rank)
        strategy = cls(config, ctx, model, _sgd(model), transports=transports)
        train_steps(strategy, model, xs, ys, rank)
        strategy.finish()
        finals[rank] = parameters_to_vector(model.parameters()).detach().clone()
        asked[rank] = transports.asked

    on_threads(peers, peer, world.barrier)
    return finals, asked


def _union_sgd(data) -> torch.Tensor:
    """One model, SGD with momentum on every peer's batch at once (the mean of their
    equal-sized losses): what a synchronous strategy must equal."""
    xs, ys = data
    model = small_net()
    opt = _sgd(model)
    for step in range(xs.shape[0]):
        opt.zero_grad()
        _loss(model, xs[step].flatten(0, 1), ys[step].flatten()).backward()
        opt.step()
    return parameters_to_vector(model.parameters()).detach()


def _alone(data, peers: int, average_after: Callable[[int], bool] = lambda done: False) -> list[torch.Tensor]:
    """Each peer's own model and optimizer on its own batches; after ``done`` steps where
    ``average_after(done)``, every model's weights become their mean (momentum stays each one's)."""
    xs, ys = data
    models = [small_net() for _ in range(peers)]
    opts = [_sgd(m) for m in models]
    for step in range(xs.shape[0]):
        for r, (m, opt) in enumerate(zip(models, opts, strict=True)):
            opt.zero_grad()
            _loss(m, xs[step, r], ys[step, r]).backward()
            opt.step()
        if average_after(step + 1):
            mean = _mean([parameters_to_vector(m.parameters()).detach() for m in models])
            for m in models:
                vector_to_parameters(mean.clone(), m.parameters())
    return [parameters_to_vector(m.parameters()).detach() for m in models]


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def _moved(weights: torch.Tensor) -> bool:
    return not torch.equal(weights, parameters_to_vector(small_net().parameters()).detach())


def test_nocomm_trains_each_peer_alone_and_asks_for_nothing() -> None:
    data = _data(PEERS)
    finals, asked = run_peers("nocomm", {}, PEERS, data)
    for rank, want in enumerate(_alone(data, PEERS)):
        assert asked[rank] == []
        assert _close(finals[rank], want), rank
    assert not torch.equal(finals[0], finals[1])  # different shards, different weights
    assert _moved(finals[0])


def test_single_is_plain_sgd_and_asks_for_nothing() -> None:
    data = _data(1)
    finals, asked = run_peers("single", {}, 1, data)
    assert asked == [[]]
    assert _close(finals[0], _union_sgd(data)) and _moved(finals[0])


def test_ps_grad_through_a_fake_star_equals_single_process_sgd() -> None:
    """Eq. 2.1: the server averages the gradients and steps (its momentum is the only
    one), every worker takes its weights: SGD on the union batch."""
    data = _data(PEERS)
    finals, asked = run_peers("ps_grad", {}, PEERS, data)
    want = _union_sgd(data)
    for rank in range(PEERS):
        assert asked[rank] == ["star shm ps_grad"]
        assert _close(finals[rank], want), rank
    assert _moved(want)


def test_ps_weight_through_a_fake_star_averages_every_interval_and_at_the_end() -> None:
    """Eq. 2.2 with K = 2: each worker steps with its own momentum; after steps 2 and 4
    the weights become their mean, and ``finish`` averages once more (5 is no multiple)."""
    data = _data(PEERS)
    finals, asked = run_peers("ps_weight", {"average_interval": 2}, PEERS, data)
    want = _alone(data, PEERS, lambda done: done % 2 == 0 or done == STEPS)
    for rank in range(PEERS):
        assert asked[rank] == ["star shm ps_weight"]
        assert _close(finals[rank], want[rank]), rank
    assert _close(finals[0], finals[2]) and _moved(finals[0])
    # without the last average the peers would differ: the check above could fail
    assert not _close(_alone(data, PEERS, lambda done: done % 2 == 0)[0], want[0])


def test_diloco_fragments_through_a_fake_allreduce_equal_algorithm_1_by_hand() -> None:
    """Streaming DiLoCo, H = 4, F = 2: fragment 0 after inner steps 4 and 8, fragment 1
    after 2 and 6; outer SGD with Nesterov momentum on the averaged pseudo-gradient."""
    steps, h, outer_lr, outer_m = 8, 4, 0.7, 0.9
    data = _data(PEERS, steps)
    options = {"sync_every": h, "fragments": 2, "outer_lr": outer_lr, "outer_momentum": outer_m}
    finals, asked = run_peers("diloco", options, PEERS, data)
    xs, ys = data
    models = [small_net() for _ in range(PEERS)]
    opts = [_sgd(m) for m in models]
    theta = parameters_to_vector(models[0].parameters()).detach().clone()  # θ^(0)
    half = theta.numel() // 2
    bounds, momentum = [(0, half), (half, theta.numel())], [None, None]
    for step in range(steps):
        for r, (m, opt) in enumerate(zip(models, opts, strict=True)):
            opt.zero_grad()
            _loss(m, xs[step, r], ys[step, r]).backward()
            opt.step()
        done = step + 1
        for f, (lo, hi) in enumerate(bounds):
            if done % h != f * h // 2:
                continue
            locals_ = [parameters_to_vector(m.parameters()).detach() for m in models]
            delta = _mean([theta[lo:hi] - w[lo:hi] for w in locals_])  # Δ = (1/k) Σ (θ - θ_i)
            momentum[f] = delta.clone() if momentum[f] is None else outer_m * momentum[f] + delta
            theta[lo:hi] -= outer_lr * (delta + outer_m * momentum[f])  # Nesterov
            for m, w in zip(models, locals_, strict=True):
                w = w.clone()
                w[lo:hi] = theta[lo:hi]
                vector_to_parameters(w, m.parameters())
    for rank in range(PEERS):
        assert asked[rank] == ["allreduce shm mean diloco.f0", "allreduce shm mean diloco.f1"]
        want = parameters_to_vector(models[rank].parameters()).detach()
        assert _close(finals[rank], want), rank
    assert not torch.equal(finals[0], finals[1])  # two inner steps since fragment 1's sync


def test_ssgd_overlap_through_a_fake_bucket_reducer_equals_single_process_sgd() -> None:
    """Gradients handed over bucket by bucket from their hooks during backward; the mean
    is only right if every bucket was launched, in the same order on every peer."""
    data = _data(PEERS)
    finals, asked = run_peers("ssgd", {"overlap": True, "bucket_mb": 100 / 2**20}, PEERS, data)
    want = _union_sgd(data)
    for rank in range(PEERS):
        assert len(asked[rank]) == 1 and asked[rank][0].startswith("bucket_reducer shm mean")
        assert int(asked[rank][0].split()[3]) > 1  # several buckets: the hooks launch them
        assert _close(finals[rank], want), rank


def test_cpu_acc_through_a_fake_host_accumulator_equals_single_process_sgd() -> None:
    """TRL Algorithm 5/6: each gradient handed to an accumulator thread as backward makes
    it, summed into the host's sum under the layer's critical counter (the fabric's own,
    on memory the peer threads share), the mean read back: SGD on the union batch."""
    data = _data(PEERS)
    finals, asked = run_peers("cpu_acc", {}, PEERS, data)
    want = _union_sgd(data)
    for rank in range(PEERS):
        assert asked[rank] == ["accumulator 4 layers", "channel cpu_acc.accumulated", "host_combiner",
                               "control"], asked[rank]
        assert _close(finals[rank], want), rank
    assert _moved(want)
