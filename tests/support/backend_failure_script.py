"""One rank of a 2-rank group on the ``shm`` backend in which something goes wrong (run by
tests/backend/test_backend.py, without torchrun: it would kill the survivor with the failed
peer).

``python backend_failure_script.py SCENARIO RANK PORT TIMEOUT_S [WORLD_SIZE]`` (2 by default;
``mismatch_across_hosts`` runs 4 ranks as 2 hosts of 2, LOCAL_WORLD_SIZE=2). Rank 1 misbehaves as
SCENARIO says; rank 0 (and rank 1 where it is still there) reports, as one JSON line
starting with ``RESULT``, what its calls did: the error's type and text, how long the
failing call took, and what a later call on the same group did.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import shmtrain  # noqa: F401 - registers the "shm" backend
from shmtrain.backend import ShmBackend, shm_backend

scenario, rank, port, timeout = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
world = int(sys.argv[5]) if len(sys.argv) > 5 else 2
dist.init_process_group("shm", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                        timeout=timedelta(seconds=timeout))
backend = shm_backend()
assert isinstance(backend, ShmBackend), type(backend)
result: dict = {"rank": rank, "inline": backend.inline}
#: elements of the calls: with a reduction thread, more than the call ring carries (a call that
#: fits runs on the caller's thread), so that the failures are the thread's
NUMEL = 1000 if backend.inline else 100_000


def attempt(call) -> dict:
    """Run ``call``; what it raised (type, text) and how long it took."""
    start = time.monotonic()
    try:
        value = call()
        return {"raised": None, "value": value, "seconds": time.monotonic() - start}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"raised": type(exc).__name__, "text": str(exc), "seconds": time.monotonic() - start,
                "runtime_error": isinstance(exc, RuntimeError)}


def all_reduce(numel: int = NUMEL) -> float:
    """SUM of ``rank + 1`` (3.0 when both of 2 ranks took part); the value left in the tensor."""
    t = torch.full((numel,), float(rank + 1))
    dist.all_reduce(t)
    return float(t[0])


def async_wait(numel: int = NUMEL) -> dict:
    """all_reduce(async_op=True): what wait(), is_success() and the future said."""
    t = torch.full((numel,), float(rank + 1))
    work = dist.all_reduce(t, async_op=True)
    waited = attempt(work.wait)
    future = attempt(lambda: work.get_future().wait() and None)
    return {"wait": waited, "is_success": work.is_success(), "future": future, "left": float(t[0])}


assert all_reduce() == world * (world + 1) / 2  # the group works before anything goes wrong
if scenario == "raise":  # the reduction itself fails on rank 1 (fault injected into its pipeline)
    if rank == 1:
        class Broken:
            def __init__(self, pipeline) -> None:
                self.close = pipeline.close

            def __call__(self, tensor, op="sum"):
                raise RuntimeError("injected fault in the pipeline")

        backend.reducer.pipeline = Broken(backend.reducer.pipeline)
    result["first"] = async_wait(200_000)  # 800 KB: more than the call ring carries, so through the pipeline
elif scenario == "raise_small":  # the same in a small call, summed from the call ring on rank 1
    if rank == 1:
        def broken(*args, **kwargs):
            raise RuntimeError("injected fault in the call ring")

        backend.reducer.calls_ring.exchange = broken
        if backend.reducer.gate is not None:  # the fault is on the Python path: rank 1 takes it, rank 0 the C++ front
            backend.reducer.gate.arm(False)
            backend.reducer.gate = None
    result["first"] = async_wait()
elif scenario in ("sys_exit", "os_exit", "sigkill"):
    if rank == 1:
        if scenario == "sys_exit":
            sys.exit(0)
        if scenario == "os_exit":
            os._exit(3)
        print("READY", flush=True)  # the test kills this rank while rank 0 waits for it
        time.sleep(3600)
    result["first"] = attempt(all_reduce)
elif scenario == "never_calls":  # rank 1 is alive but calls only after rank 0 gave up
    if rank == 1:
        time.sleep(timeout + 3)
    result["first"] = attempt(all_reduce)
elif scenario in ("mismatch", "mismatch_large"):  # large: rank 1's data does not travel with its header
    result["first"] = async_wait(NUMEL if rank == 0 else (10 if scenario == "mismatch" else 200_000))
    # the backend's own Work (torch hands dist.* callers a holder that forwards wait() and
    # the future only): completed, not a success, its exception the group's failure
    own = backend.allreduce([torch.ones(3)])
    attempt(own.wait)  # raises (on the group's thread the work may not be done before)
    result["own_work"] = {"is_completed": own.is_completed(), "is_success": own.is_success(),
                          "exception": type(own.exception()).__name__}
elif scenario == "mismatch_across_hosts":  # each host agrees inside; the hosts differ
    result["first"] = async_wait(1000 if rank < 2 else 10)
elif scenario == "ddp_peer_exit":  # DDP trains; rank 1 leaves after 2 steps
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    before = ShmBackend.reductions

    def train(steps: int) -> None:
        for _ in range(steps):
            model(torch.randn(8, 32)).sum().backward()

    train(2)
    result["bucket_reductions"] = ShmBackend.reductions - before
    if rank == 1:
        sys.exit(0)
    result["first"] = attempt(lambda: train(1))
elif scenario == "requires_grad":  # reduced on its data, as gloo does (it used to be left unreduced)
    t = torch.full((1000,), float(rank + 1), requires_grad=True)
    strided = torch.full((100, 20), float(rank + 1))[:, ::2]
    work = dist.all_reduce(t, async_op=True)
    result["first"] = {"is_success": work.wait() and work.is_success(), "left": float(t.detach()[0]),
                       "grad_fn": t.grad_fn is not None}
    dist.all_reduce(strided)
    result["strided"] = float(strided.min()), float(strided.max())
else:
    raise SystemExit(f"unknown scenario {scenario!r}")

# a later call on the same group: it must raise, never return the input
result["later"] = attempt(all_reduce)
result["later_gloo"] = attempt(lambda: dist.broadcast(torch.zeros(3), src=0))
print("RESULT " + json.dumps(result), flush=True)
signal.alarm(30)  # tearing down a group whose peer is gone must not hang the test
dist.destroy_process_group()
