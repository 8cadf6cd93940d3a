"""The initial weights: every worker starts from rank 0's, and they cross the link only
when some worker built different ones (``strategies/layout/flat.py``'s ``broadcast_parameters``:
an all-gather of SHA-256 digests first, the dense broadcast only on a mismatch)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

from shmtrain.fabric.exchanges.weights import broadcast_parameters, weights_digest
from shmtrain.runtime.launch.launcher import launch
from shmtrain.strategies.layout.flat import FlatLayout

#: digest bytes per worker
DIGEST = 32


class ThreadComm:
    """``all_gather`` and ``broadcast`` among threads that play ``hosts`` hosts of equal
    size; counts what each rank sends to ranks on other hosts (a flat exchange: what the
    sender's tensor would cost on the link per receiver there)."""

    def __init__(self, world: int, hosts: int) -> None:
        self.world, self.per_host = world, world // hosts
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots: list[Any] = [None] * world
        self.across = [0] * world
        self.broadcasts = 0

    def others(self, rank: int) -> int:
        return sum(1 for r in range(self.world) if r // self.per_host != rank // self.per_host)

    def view(self, rank: int) -> Any:
        comm = self

        class View:
            def get_world_size(self) -> int:
                return comm.world

            def all_gather(self, out: list[torch.Tensor], tensor: torch.Tensor) -> None:
                comm.slots[rank] = tensor.clone()
                comm.across[rank] += tensor.nbytes * comm.others(rank)
                comm.barrier.wait()
                for r, o in enumerate(out):
                    o.copy_(comm.slots[r])
                comm.barrier.wait()

            def broadcast(self, tensor: torch.Tensor, src: int) -> None:
                if rank == src:
                    comm.slots[src] = tensor.clone()
                    comm.across[src] += tensor.nbytes * comm.others(src)
                    comm.broadcasts += 1
                comm.barrier.wait()
                tensor.copy_(comm.slots[src])
                comm.barrier.wait()

        return View()


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 10))


def _start(seeds: list[int], hosts: int = 2) -> tuple[ThreadComm, list[bool], list[torch.Tensor]]:
    """Every rank builds its model from its seed and calls ``broadcast_parameters``."""
    world = len(seeds)
    comm = ThreadComm(world, hosts)
    models = [_model(s) for s in seeds]  # one after another: torch's RNG is global
    layouts = [FlatLayout(list(m.parameters())) for m in models]
    sent: list[Any] = [None] * world
    errors: list[BaseException] = []

    def peer(rank: int) -> None:
        try:
            sent[rank] = broadcast_parameters(layouts[rank], comm=comm.view(rank))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            comm.barrier.abort()

    threads = [threading.Thread(target=peer, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return comm, sent, [layout.gather() for layout in layouts]


def test_the_same_seed_everywhere_sends_only_the_digests_across_hosts() -> None:
    """2 hosts x 2, one seed: no weights cross; each rank's 32-byte digest reaches the 2
    ranks of the other host, and nothing else is sent."""
    comm, sent, finals = _start([3, 3, 3, 3])
    assert sent == [False] * 4 and comm.broadcasts == 0
    assert comm.across == [DIGEST * 2] * 4
    numel = finals[0].numel()
    assert sum(comm.across) < 4 * numel / 10  # the weights once across would be 4·P bytes per receiver
    assert all(torch.equal(finals[0], f) for f in finals)


def test_a_digest_mismatch_still_broadcasts_rank_0s_weights() -> None:
    """One worker built other weights: the digests differ, so rank 0 sends its weights
    densely and every worker ends with its bits (the digest decides, never luck)."""
    reference = FlatLayout(list(_model(3).parameters())).gather()
    comm, sent, finals = _start([3, 3, 3, 4])
    assert sent == [True] * 4 and comm.broadcasts == 1
    assert comm.across[0] == DIGEST * 2 + reference.nbytes * 2  # the digests, then the weights to host b
    assert all(torch.equal(f, reference) for f in finals)
    comm, sent, finals = _start([5, 3, 3, 3])  # rank 0 the odd one: its weights win
    assert sent == [True] * 4
    assert all(torch.equal(f, FlatLayout(list(_model(5).parameters())).gather()) for f in finals)


def test_the_digest_is_of_the_bits() -> None:
    flat = torch.randn(1000)
    assert torch.equal(weights_digest(flat), weights_digest(flat.clone()))
    nudged = flat.clone()
    nudged[500] = torch.nextafter(nudged[500], torch.tensor(1e9))  # one float's last bit
    assert not torch.equal(weights_digest(flat), weights_digest(nudged))
    assert weights_digest(flat).dtype == torch.int64 and weights_digest(flat).nbytes == DIGEST
    assert not torch.equal(weights_digest(torch.zeros(4)), weights_digest(-torch.zeros(4)))  # -0.0: other bits


def gloo_worker(ctx: Any, seeds: list[int]) -> dict[str, Any]:
    """On a real gloo group: the seeds' models, ``broadcast_parameters``, and what went
    through ``torch.distributed`` (calls and bytes)."""
    import torch.distributed as dist

    class Counting:
        def __init__(self) -> None:
            self.calls: list[tuple[str, int]] = []

        def get_world_size(self) -> int:
            return dist.get_world_size()

        def all_gather(self, out: list[torch.Tensor], tensor: torch.Tensor) -> None:
            self.calls.append(("all_gather", tensor.nbytes))
            dist.all_gather(out, tensor)

        def broadcast(self, tensor: torch.Tensor, src: int) -> None:
            self.calls.append(("broadcast", tensor.nbytes))
            dist.broadcast(tensor, src=src)

    out = {}
    for case, seed in enumerate(seeds):
        layout = FlatLayout(list(_model(seed + (ctx.rank if case else 0)).parameters()))
        comm = Counting()
        sent = broadcast_parameters(layout, comm=comm)
        out[case] = {"sent": sent, "calls": comm.calls, "weights": layout.gather(),
                     "default": broadcast_parameters(layout)}  # again through dist itself: now equal
    return out


@pytest.mark.timeout(120)
def test_on_gloo_the_digests_decide_and_a_mismatch_broadcasts() -> None:
    """Two real processes on a gloo group: the same seed sends 32 bytes each and no
    weights; seeds that depend on the rank send rank 0's weights, and both then agree."""
    results = launch("strategies.layout.test_initial_weights:gloo_worker", 2, [7, 7], timeout=120)
    same = [r[0] for r in results]
    assert [s["sent"] for s in same] == [False, False]
    assert [s["calls"] for s in same] == [[("all_gather", DIGEST)]] * 2
    differ = [r[1] for r in results]
    assert [s["sent"] for s in differ] == [True, True]
    numel_bytes = differ[0]["weights"].nbytes
    assert [s["calls"] for s in differ] == [[("all_gather", DIGEST), ("broadcast", numel_bytes)]] * 2
    assert torch.equal(differ[0]["weights"], differ[1]["weights"])
    assert torch.equal(differ[0]["weights"], FlatLayout(list(_model(7).parameters())).gather())
    assert [s["default"] for r in results for s in r.values()] == [False] * 4
