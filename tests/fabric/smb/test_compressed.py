"""The compressed exchange with a memory server across a link (``--compress`` for easgd,
seasgd, hsgd; fabric/smb/compressed.py): an in-process ``MemoryServer`` on loopback and
its clients, so every byte that moves is a real gloo message of a known size.

- a read is dense once per connection, then the compressed difference against the
  client's mirror, which the server keeps the same, bit for bit;
- an accumulate adds D(C(increment + e)) into W_g and keeps e (error feedback);
- SEASGD's exchange (ElasticExchange) without ``--compress`` is eqs. (5)-(7) bit for bit;
- which worker compresses, the checkpoint's part and its refusal, the re-sync after a
  new connection; and (slow) seasgd across two torchrun hosts on loopback.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from shmtrain.fabric.compress.codec import Codec, parse_compress
from shmtrain.fabric.smb.compressed import CompressedGlobal, codec_of, spec_code
from shmtrain.fabric.smb.remote import RemoteBufferService
from shmtrain.fabric.smb.server import MemoryServer
from shmtrain.strategies.elastic.compress import across_link, load_compress
from shmtrain.strategies.elastic.seasgd import ElasticExchange
from shmtrain.timing import PhaseTimer

pytestmark = pytest.mark.timeout(90)
NUMEL = 10_000  # 3 chunks, the last one padded


class Server:
    """A memory server of ``clients`` serving in a thread of this process."""

    def __init__(self, clients: int) -> None:
        self.log: list[str] = []
        self.server = MemoryServer(clients, timeout=30, log=self.log.append)
        self.thread = threading.Thread(target=self.server.serve, daemon=True)
        self.thread.start()

    def client(self, rank: int, world: int) -> RemoteBufferService:
        return RemoteBufferService(self.server.address, rank, world, timeout=30)

    def mirror(self, client_rank: int, buffer_id: int) -> torch.Tensor:
        return self.server.mirrors[(client_rank + 1, buffer_id)][1]


@pytest.fixture
def one() -> Iterator[tuple[Server, RemoteBufferService]]:
    server = Server(1)
    service = server.client(0, 1)
    yield server, service
    service.close()
    server.thread.join(10)
    assert not server.thread.is_alive()


def _global(service: RemoteBufferService, values: torch.Tensor):
    buffer = service.attach(service.create("global_weights", values.numel()))
    service.write(buffer, values)
    return buffer


def test_reads_are_dense_once_then_the_compressed_difference_against_a_shared_mirror(one) -> None:
    server, service = one
    start = torch.randn(NUMEL)
    buffer = _global(service, start)
    view = CompressedGlobal(service, buffer, parse_compress("topk:0.05,bits:4"))
    payload = view.codec.nbytes
    assert payload < 4 * NUMEL / 10
    out = torch.empty(NUMEL)
    assert torch.equal(view.read(out), start) and view.bytes_down == 4 * NUMEL  # the dense first read
    moved = start + torch.randn(NUMEL)
    service.write(buffer, moved)
    errors = []
    for reads in range(1, 41):
        view.read(out)
        # the landing is the payload's size: gloo refuses a message of any other size
        assert view.bytes_down == 4 * NUMEL + reads * payload
        assert torch.equal(view.mirror, server.mirror(0, buffer.key.id))  # both sides hold the same copy
        errors.append(float((out - moved).abs().max()))
    assert errors[0] > 0.5 and errors[-1] < 0.01 * errors[0]  # what a read left out comes with the next ones


def test_an_accumulate_adds_the_decompressed_increment_and_keeps_the_rest(one) -> None:
    server, service = one
    buffer = _global(service, torch.zeros(NUMEL))
    spec = parse_compress("topk:0.1,bits:8")
    view = CompressedGlobal(service, buffer, spec)
    increment = torch.randn(NUMEL)
    applied = view.accumulate(increment)
    assert applied == 1 and view.bytes_up == view.codec.nbytes
    total = service.read(buffer, torch.empty(NUMEL))
    sent = total.count_nonzero().item()
    assert 0.9 * 3 * view.codec.k < sent <= 3 * view.codec.k  # the top k of each chunk, nothing else
    # error feedback: what was sent plus what is kept is the increment
    torch.testing.assert_close(total + view.compressor.error[:NUMEL], increment, rtol=0, atol=1e-6)
    for _ in range(60):  # nothing new: the kept rest goes out over the next accumulates
        view.accumulate(torch.zeros(NUMEL))
    total = service.read(buffer, torch.empty(NUMEL))
    assert float((total - increment).abs().max()) < 0.02 * float(increment.abs().max())
    assert server.server.applied == 61


def test_without_feedback_the_rest_is_never_sent(one) -> None:
    _, service = one
    buffer = _global(service, torch.zeros(NUMEL))
    view = CompressedGlobal(service, buffer, parse_compress("topk:0.1,bits:32,feedback:off"))
    increment = torch.randn(NUMEL)
    view.accumulate(increment)
    first = service.read(buffer, torch.empty(NUMEL))
    for _ in range(5):
        view.accumulate(torch.zeros(NUMEL))
    assert torch.equal(service.read(buffer, torch.empty(NUMEL)), first)
    assert float((first - increment).abs().max()) > 0.5


def test_a_compressed_read_without_the_dense_one_or_with_a_bad_code_is_refused(one) -> None:
    server, service = one
    buffer = _global(service, torch.ones(NUMEL))
    view = CompressedGlobal(service, buffer, parse_compress("topk:0.1,bits:4"))
    view.synced = True  # as if it had read densely: the server holds no mirror for it
    with pytest.raises(ValueError, match="malformed request"):
        view.read(torch.empty(NUMEL))
    assert any("without a dense read first" in line for line in server.log)
    assert codec_of(NUMEL, 3 << 8 | 5) is None and codec_of(NUMEL, 0 << 8 | 4) is None  # 5 bits; k = 0
    code = spec_code(Codec(NUMEL, parse_compress("topk:0.01,bits:2")))
    assert codec_of(NUMEL, code).k == Codec(NUMEL, parse_compress("topk:0.01,bits:2")).k
    view.synced = False  # served as usual afterwards
    assert torch.equal(view.read(torch.empty(NUMEL)), torch.ones(NUMEL))


def _reference(start: torch.Tensor, weights: list[torch.Tensor], alpha: float, rounds: int) -> tuple:
    """ShmCaffe eqs. (5)-(7) for the workers in turn (the order the test drives them)."""
    w_g = start.clone()
    for _ in range(rounds):
        for w in weights:
            d = w - w_g
            w.sub_(d, alpha=alpha)
            w_g.add_(d.mul_(alpha))
    return w_g, weights


def _drive(service, buffer, increments, weights, compressed, rounds, alpha=0.2):
    exchanges = [ElasticExchange(service, buffer, inc, w, alpha, PhaseTimer(), 30.0, None, c)
                 for inc, w, c in zip(increments, weights, compressed, strict=True)]
    try:
        for _ in range(rounds):
            for exchange in exchanges:
                exchange.exchange()
                exchange.drain()
    finally:
        for exchange in exchanges:
            exchange.close()
    return service.read(buffer, torch.empty(NUMEL))


def test_seasgd_without_compression_is_the_equations_bit_for_bit_and_compressed_close(one) -> None:
    """Two workers' ElasticExchange through the server, driven in turn: the whole-weights
    path gives eqs. (5)-(7) exactly; with one worker compressed (the other beside the
    server) the global weights stay close and the compressed worker's payloads moved."""
    _, service = one
    start = torch.randn(NUMEL)
    locals_ = [start + torch.randn(NUMEL), start - torch.randn(NUMEL)]
    buffer = _global(service, start)
    increments = [service.attach(service.create(f"weight_increment.{i}", NUMEL)) for i in range(2)]
    dense = _drive(service, buffer, increments, [w.clone() for w in locals_], [None, None], 5)
    w_g, _ = _reference(start, [w.clone() for w in locals_], 0.2, 5)
    assert torch.equal(dense, w_g)
    service.write(buffer, start)
    view = CompressedGlobal(service, buffer, parse_compress("topk:0.5,bits:8"))
    compressed = _drive(service, buffer, increments, [w.clone() for w in locals_], [None, view], 5)
    assert view.bytes_up == 5 * view.codec.nbytes and view.bytes_down == 4 * NUMEL + 4 * view.codec.nbytes
    assert float((compressed - w_g).norm() / w_g.norm()) < 0.05


def test_the_exchange_conserves_the_roots_and_the_global_weights_sum(one) -> None:
    """Eqs. (6)-(7) move W_x and W_g by the same dW_x in opposite directions, so every
    exchange keeps the sum of the exchanging models and W_g (across the link with the part
    of dW_x still in the error feedback): with two HSGD roots W_g is one of three bodies of
    equal weight, and the consensus moves by two thirds of a root's step
    (docs/choosing_a_method.md, the reason hsgd-topk takes a larger step than seasgd-topk)."""
    _, service = one
    start = torch.randn(NUMEL)
    roots = [start + torch.randn(NUMEL), start - torch.randn(NUMEL)]
    buffer = _global(service, start)
    increments = [service.attach(service.create(f"weight_increment.{i}", NUMEL)) for i in range(2)]
    view = CompressedGlobal(service, buffer, parse_compress("topk:0.1,bits:4"))
    before = roots[0] + roots[1] + start
    w_g = _drive(service, buffer, increments, roots, [None, view], 4, alpha=0.5)
    after = roots[0] + roots[1] + w_g + view.compressor.error[:NUMEL]
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)
    assert float(view.compressor.error.abs().max()) > 0.01  # some of dW_x is still on its way


def test_a_new_connection_reads_densely_and_agrees_with_the_server() -> None:
    """A resume or a rejoin is a new connection of the rank: the server forgets the old
    mirror, the client's first read is dense, so both hold W_g again; the checkpoint
    carries the error feedback, exactly."""
    server = Server(1)
    service = server.client(0, 1)
    buffer = _global(service, torch.randn(NUMEL))
    spec = parse_compress("topk:0.1,bits:4")
    view = CompressedGlobal(service, buffer, spec)
    view.read(torch.empty(NUMEL))
    view.accumulate(torch.randn(NUMEL))
    state = view.state_dict()
    service.close()
    server.thread.join(10)
    assert not server.thread.is_alive()
    # a second server stands for the restarted job (the resumed master writes W_g back)
    server = Server(1)
    service = server.client(0, 1)
    values = torch.randn(NUMEL)
    buffer = _global(service, values)
    resumed = CompressedGlobal(service, buffer, spec)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.compressor.error, state["error"])
    assert torch.equal(resumed.read(torch.empty(NUMEL)), values)
    assert torch.equal(resumed.mirror, server.mirror(0, buffer.key.id))
    service.close()
    server.thread.join(10)


def test_the_checkpoint_with_other_compression_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="written with no --compress, this run has --compress topk:0.1,bits:4"):
        load_compress("topk:0.1,bits:4", None, None)
    with pytest.raises(ValueError, match="written with --compress topk:0.01,bits:4, this run has none"):
        load_compress("", None, {"spec": "topk:0.01,bits:4"})
    with pytest.raises(ValueError, match="topk:0.01,bits:4, this run has --compress topk:0.01,bits:2"):
        load_compress("topk:0.01,bits:2", None, {"spec": "topk:0.01,bits:4"})
    load_compress("topk:0.01,bits:4", None, {"spec": "topk:0.01,bits:4"})  # a worker beside the server
    load_compress("", None, None)


def test_only_a_worker_across_the_link_compresses() -> None:
    job = SimpleNamespace(smb_server="")
    assert not across_link(job, SimpleNamespace(num_nodes=1, node_rank=0))
    assert not across_link(job, SimpleNamespace(num_nodes=2, node_rank=0))  # beside the job's server
    assert across_link(job, SimpleNamespace(num_nodes=2, node_rank=1))
    assert not across_link(SimpleNamespace(smb_server="127.0.0.1:29600"), SimpleNamespace(num_nodes=2, node_rank=1))


def test_the_option_is_taken_by_the_elastic_strategies_and_checked() -> None:
    from shmtrain.strategies.base import build_config

    for name in ("seasgd", "hsgd", "easgd"):
        assert build_config(name, {"compress": "topk:0.1,bits:4"}).compress == "topk:0.1,bits:4"
    with pytest.raises(ValueError, match="--compress 'topk:2'"):
        build_config("seasgd", {"compress": "topk:2"})


@pytest.mark.slow  # two torchrun hosts on loopback: 25-50 s each on 2 cores
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["seasgd", "hsgd", "easgd"])
def test_two_hosts_compress_across_the_link_only_and_learn(tmp_path, strategy: str) -> None:
    """Two torchrun launches, one host of 2 each, the job's own memory server next to rank
    0: host 1's workers (hsgd: its group root) say they compress, host 0's do not; the job
    ends with every worker's work counted (TERM average) and its model learned."""
    import json

    from support.torchrun import start_hosts

    nodes = start_hosts(tmp_path, ["--strategy", strategy, "--iterations", "20", "--batch-size", "16",
                                   "--compress", "topk:0.1,bits:4", "--host-lead", "0.1", "--no-progress"])
    outputs = [p.communicate(timeout=240)[0].decode() for p in nodes]
    assert all(p.returncode == 0 for p in nodes), outputs
    said = "exchanges with the memory server across the link compressed"
    assert said not in outputs[0] and outputs[1].count(said) == (1 if strategy == "hsgd" else 2), outputs
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert sum(summary["iterations_per_rank"].values()) >= 4 * 20
    assert summary["accuracy"] > 0.2, summary["accuracy"]  # ten classes: 0.1 by chance
