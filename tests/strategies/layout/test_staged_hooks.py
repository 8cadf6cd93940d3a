"""Staged gradient hooks only enqueue: the host work runs on another thread.

On a GPU a hook that waits, or reduces on the host, holds the thread that launches
backward's kernels (TRL Algorithm 6: the hook starts ``MemcpyD2HAsync``; a host thread
does the rest). On the CPU, with the staged copy mode (``SHMTRAIN_STAGING=copy``), the
host work of each staged strategy (ssgd --overlap's bucket launches, gpi's reductions,
cpu_acc's accumulations) is gated by an instrumented fake that holds it until backward
has returned: backward still finishes (no hook waited for it), no host work finished
before, every piece of it ran off the training thread, and once the gate opens the step
completes. On a GPU, backward of every staged strategy runs under
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

from shmtrain.runtime.launch.launcher import launch
from shmtrain.strategies.layout.staging import STAGING_ENV

pytestmark = pytest.mark.timeout(180)

#: what a staged strategy does on the host per bucket or layer (the gated call)
GATED = {"ssgd_overlap": ("reducer", "launch"), "gpi": (None, "_reduce"), "cpu_acc": (None, "_accumulate")}
OPTIONS = {"ssgd_overlap": ("ssgd", {"overlap": True, "bucket_mb": 0.5}), "gpi": ("gpi", {}),
           "cpu_acc": ("cpu_acc", {}), "ssgd": ("ssgd", {}), "ps_grad": ("ps_grad", {})}
GATE_S = 10.0  # a hook that waited for the gated work would hold backward this long


def _model(device: torch.device) -> nn.Module:
    """The 512x512 layer (2^18 weights) is cpu_acc's hand-off batch: handed over in backward."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 4)).to(device)


def _gate(obj: Any, name: str, gate: threading.Event, events: list[tuple]) -> None:
    """Make ``obj.name`` wait for ``gate`` (at most GATE_S) and record where and when it ran."""
    original = getattr(obj, name)

    def gated(*args: Any, **kwargs: Any) -> Any:
        events.append(("work-start", threading.get_ident()))
        gate.wait(GATE_S)
        try:
            return original(*args, **kwargs)
        finally:
            events.append(("work-end", threading.get_ident()))

    setattr(obj, name, gated)


def test_the_courier_runs_calls_in_order_off_the_caller_and_hands_errors_back() -> None:
    from shmtrain.strategies.layout.courier import Courier

    courier, seen = Courier(torch.device("cpu"), "test-courier"), []
    for i in range(5):
        courier.submit(lambda i=i: seen.append((i, threading.get_ident())))
    assert courier.drain(10) >= 0
    assert [i for i, _ in seen] == list(range(5)) and {t for _, t in seen} == {courier.ident}
    assert courier.ident != threading.get_ident()
    held = threading.Event()
    courier.submit(held.wait)
    with pytest.raises(TimeoutError, match=r"test-courier: 1 staged call\(s\) not done after 0 s"):
        courier.drain(0.2)
    held.set()

    def fail() -> None:
        raise ValueError("copy failed")

    courier.submit(fail)
    courier.submit(lambda: seen.append("after"))  # dropped: the courier stopped at the error
    with pytest.raises(ValueError, match="copy failed"):
        courier.drain(10)
    with pytest.raises(ValueError, match="copy failed"):
        courier.submit(lambda: None)
    courier.close()
    assert "after" not in seen and not courier._thread.is_alive()


def gated_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    """Per strategy: one gated step, then one more ungated; the events seen."""
    from shmtrain.parallel.data_parallel import DataParallel

    os.environ[STAGING_ENV] = "copy"
    out = {}
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    for mode in payload["modes"]:
        model = _model(torch.device("cpu"))
        strategy, options = OPTIONS[mode]
        dp = DataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy, ctx=ctx,
                          ddp_style=False, **options)
        assert dp.strategy.staged
        gate, events = threading.Event(), []
        owner, name = GATED[mode]
        _gate(getattr(dp.strategy, owner) if owner else dp.strategy, name, gate, events)
        params = list(model.parameters())
        for i, p in enumerate(params):  # after the strategy's own hook: it has returned
            p.register_post_accumulate_grad_hook(lambda _p, i=i, seen=events: seen.append(("hook-returned", i)))
        dp.zero_grad()
        start = time.perf_counter()
        nn.functional.cross_entropy(dp(x), y).backward()
        events.append(("backward-returned", time.perf_counter() - start))
        gate.set()
        dp.step()
        dp.zero_grad()  # a second step, nothing held
        nn.functional.cross_entropy(dp(x), y).backward()
        dp.step()
        finite = all(torch.isfinite(p).all() for p in params)
        dp.close()
        out[mode] = {"events": events, "main": threading.get_ident(), "finite": bool(finite),
                     "params": len(params)}
    return out


def test_staged_hooks_leave_the_host_work_to_another_thread() -> None:
    modes = sorted(GATED)
    result = launch("strategies.layout.test_staged_hooks:gated_worker", 1, {"modes": modes}, timeout=150)[0]
    for mode in modes:
        run = result[mode]
        events, main = run["events"], run["main"]
        kinds = [e[0] for e in events]
        back = kinds.index("backward-returned")
        hooks = [e[1] for e in events[:back] if e[0] == "hook-returned"]
        # every hook returned, in backward order (the last layer's first), while the
        # gated host work was held: none of it finished before backward returned
        assert sorted(hooks) == list(range(run["params"])) and hooks[:2] == [run["params"] - 1,
                                                                               run["params"] - 2], (mode, hooks)
        assert "work-end" not in kinds[:back], f"{mode}: a hook waited for the host work ({events})"
        assert events[back][1] < GATE_S, f"{mode}: backward took {events[back][1]:.1f} s (held by a hook)"
        # the host work ran, off the training thread, and the steps completed
        work = [e for e in events if e[0].startswith("work")]
        assert work and all(thread != main for _, thread in work), (mode, work)
        assert kinds.count("work-start") == kinds.count("work-end") and run["finite"], mode


def sync_free_worker(ctx, payload: dict[str, Any]) -> dict[str, str]:
    """On the GPU: per staged strategy, backward under ``set_sync_debug_mode("error")``
    (a synchronizing call raises); the error per strategy, empty if none."""
    from shmtrain.parallel.data_parallel import DataParallel

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    x, y = torch.randn(8, 16, device=device), torch.randint(0, 4, (8,), device=device)
    errors = {}
    for mode in payload["modes"]:
        model = _model(device)
        strategy, options = OPTIONS[mode]
        dp = DataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy, ctx=ctx,
                          ddp_style=False, **options)
        errors[mode] = ""
        try:
            for _ in range(3):
                dp.zero_grad()
                loss = nn.functional.cross_entropy(dp(x), y)
                torch.cuda.set_sync_debug_mode("error")
                try:
                    loss.backward()
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                dp.step()  # raises what the courier met during backward
        except RuntimeError as exc:
            errors[mode] = f"{type(exc).__name__}: {exc}"
        finally:
            torch.cuda.set_sync_debug_mode(0)
            dp.close()
    return errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_staged_backward_never_synchronizes() -> None:
    modes = sorted(OPTIONS)
    results = launch("strategies.layout.test_staged_hooks:sync_free_worker", 2, {"modes": modes}, timeout=170)
    for rank, errors in enumerate(results):
        assert errors == dict.fromkeys(modes, ""), f"rank {rank}: {errors}"


def pipelined_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    """ssgd --overlap staged: which buckets' means were started back during backward."""
    from shmtrain.parallel.data_parallel import DataParallel

    os.environ[STAGING_ENV] = "copy"
    model = _model(torch.device("cpu"))
    strategy, options = OPTIONS["ssgd_overlap"]
    dp = DataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy, ctx=ctx,
                      ddp_style=False, **options)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    dp.zero_grad()
    nn.functional.cross_entropy(dp(x), y).backward()
    dp.strategy.courier.drain(30)  # what backward handed over is done; after_backward not yet run
    early = [i for i, _ in dp.strategy.staging._h2d_copies]
    dp.step()
    result = {"early": early, "params": len(dp.strategy.order), "buckets": len(dp.strategy.bucket_ranges)}
    dp.close()
    return result


def test_staged_overlap_copies_each_reduced_bucket_back_during_backward() -> None:
    """One worker: a bucket is reduced as soon as it is launched, so the courier starts its
    copy back at once; every parameter's mean is on its way before after_backward."""
    result = launch("strategies.layout.test_staged_hooks:pipelined_worker", 1, {}, timeout=90)[0]
    assert result["buckets"] > 1
    assert sorted(result["early"]) == list(range(result["params"])), result
