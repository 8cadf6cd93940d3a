"""Host staging (TRL Algorithm 6's copies): a pass-through on the CPU, asynchronous copies
through pinned buffers on two streams on a GPU."""

from __future__ import annotations

import mmap

import pytest
import torch
from torch import nn

from shmtrain.strategies.layout.flat import FlatLayout
from shmtrain.strategies.layout.staging import Copy, HostStaging


def _params(device: str) -> list[nn.Parameter]:
    torch.manual_seed(0)
    return list(nn.Linear(5, 3, device=device).parameters())  # weight (3, 5), bias (3,)


def test_cpu_staging_passes_host_tensors_through() -> None:
    cuda_was_initialized = torch.cuda.is_initialized()
    params = _params("cpu")
    staging = HostStaging(FlatLayout(params), torch.device("cpu"))
    assert staging.copies is False
    staging.register(torch.zeros(8))  # nothing to page-lock
    assert staging.registered() == "n/a" and staging.registrations == []

    grad = torch.randn(3, 5)
    host, handle = staging.to_host(0, grad)
    assert host is grad and handle is None  # no copy: the gradient itself
    assert staging.host_ready(handle) == 0.0

    shared = FlatLayout(params).views(torch.randn(18))  # stands for a shared segment
    for i, p in enumerate(params):
        staging.to_device(i, p, shared[i])
        assert p.grad is shared[i]
        assert p.grad.data_ptr() == shared[i].data_ptr()  # a view of host memory, no copy
    shared[1].fill_(7.0)
    assert torch.equal(params[1].grad, torch.full((3,), 7.0))

    staging.join()
    assert staging.device_times() == []
    staging.close()
    if not cuda_was_initialized:
        assert not torch.cuda.is_initialized()  # the CPU path touches no CUDA state


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned memory, streams)")
def test_cuda_round_trip_is_exact() -> None:
    params = _params("cuda")
    layout = FlatLayout(params)
    staging = HostStaging(layout, params[0].device)
    assert staging.copies is True
    # pageable and page-aligned, as the shared segment (an anonymous mapping)
    segment = mmap.mmap(-1, mmap.PAGESIZE)
    shared = torch.frombuffer(segment, dtype=torch.float32, count=layout.numel)
    staging.register(shared)
    assert staging.registered() == "1/1"  # the bench's registered column
    staging.register(shared)  # a range registered already is not registered twice, but counts
    assert staging.registered() == "2/2"
    sums = layout.views(shared)

    gen = torch.Generator().manual_seed(1)
    originals = [torch.randn(p.shape, generator=gen).cuda() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    for i in reversed(range(len(params))):  # backward order
        grad = originals[i].clone()
        host, handle = staging.to_host(i, grad)
        del grad  # the allocator keeps it until the copy is done (record_stream)
        assert host.is_pinned() and host.device.type == "cpu"
        assert staging.host_ready(handle) >= 0.0
        sums[i].copy_(host)  # the host's accumulation (one worker: the sum is the partial)
        staging.to_device(i, params[i], sums[i])
    staging.join()
    for p, original in zip(params, originals, strict=True):
        assert torch.equal(p.grad, original)
    times = staging.device_times()
    assert sorted(i for i, _ in times) == [0, 1] and all(t >= 0.0 for _, t in times)
    assert staging.device_times() == []  # cleared
    assert staging.bounced_bytes == 0  # registered and pinned host sides: DMA, no bounce
    staging.close()  # unregisters the shared buffers before they are freed


class _Event:
    """A CUDA event's polling interface, landed when told."""

    def __init__(self) -> None:
        self.landed = False

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.landed = True

    def elapsed_time(self, end: _Event) -> float:  # noqa: ARG002 - the event interface
        return 2.0  # ms


def test_a_bounced_copy_reaches_its_destination_once_it_has_landed() -> None:
    """A copy to host through a pinned bounce buffer: the destination is written by the
    first done() that sees the copy landed (or by wait()), once, never before."""
    bounce, dst, runs = torch.arange(4.0), torch.zeros(4), []
    end = _Event()
    copy = Copy(events=(_Event(), end), then=lambda: runs.append(dst.copy_(bounce)))
    assert not copy.done() and torch.equal(dst, torch.zeros(4)) and runs == []
    end.landed = True
    assert copy.done() and torch.equal(dst, bounce) and len(runs) == 1
    assert copy.wait() == 0.002 and len(runs) == 1  # the seconds of the events; not run again
    waited = Copy(events=(_Event(), _Event()), then=lambda: runs.append(1))
    assert waited.wait() == 0.002 and len(runs) == 2 and waited.done()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned memory, streams)")
def test_cuda_copies_of_unlocked_host_memory_go_through_pinned_bounce_buffers() -> None:
    params = _params("cuda")
    layout = FlatLayout(params)
    staging = HostStaging(layout, params[0].device)
    pageable = torch.zeros(layout.numel)  # never registered: not page-locked
    assert not pageable.is_pinned()
    views = layout.views(pageable)
    grads = [torch.randn(p.shape, device="cuda") for p in params]
    copies = [staging.to_host(i, g, dst=views[i])[1] for i, g in enumerate(grads)]
    assert all(c.wait() >= 0.0 for c in copies)
    assert all(torch.equal(v, g.cpu()) for v, g in zip(views, grads, strict=True))
    assert staging.bounced_bytes == 4 * layout.numel
    for i, p in enumerate(params):  # and back, from the pageable buffer
        staging.to_device(i, p, views[i] * 2)
    staging.join()
    assert all(torch.equal(p.grad, 2 * g) for p, g in zip(params, grads, strict=True))
    assert staging.bounced_bytes == 8 * layout.numel
    staging.close()
