"""``shmtrain bench floors``: what one small collective costs at each layer of the ``shm``
backend, to decide where its per-call time goes.

Every figure is the least mean per call over 5 rounds of many calls of a 4 KiB float32 tensor (``--bytes``):

- ``dispatch_cpp``: ``dist.all_reduce`` into torch's ``fake`` backend, a C++ backend that
  does nothing (torch.distributed's own dispatch into a C++ backend; one process);
- ``dispatch_python``: the same into a Python c10d ``Backend`` that does nothing and returns
  the ``shm`` backend's finished :class:`~shmtrain.backend.work.ShmWork` (the dispatch into
  a Python backend and the Work it returns);
- ``thread_handoff``: a call handed to another thread through a queue and waited for
  (what a reduction thread costs per call);
- ``copy``: ``copy_`` of the tensor (into a slot and back out is two);
- ``pipeline``: the host's pipelined allreduce between 2 processes
  (:class:`~shmtrain.fabric.allreduce.pipeline.PipelinedAllreduce`, its compiled path for
  float32: the copies, the hand-off between the processes, the sum; what a tensor too large
  for the call ring goes through after its header);
- ``headers``: the backend's call header hand-off alone between the 2 processes (the call
  ring, :mod:`~shmtrain.backend.calls`; what a call too large for it begins with);
- ``carried``: the same hand-off carrying the tensor, and its sum from there (what a small
  ``all_reduce`` does inside the backend: :meth:`HostReducer.begin
  <shmtrain.backend.reducer.HostReducer.begin>` with the tensor's data);
- ``backend_call``: the backend's ``allreduce(...).wait()`` called directly (no torch
  dispatch; the call's hand-off and sum, the ``ShmWork``);
- ``shm_front``: ``dist.all_reduce`` on ``cpu:shm`` between 2 processes through its C++
  front (:mod:`~shmtrain.backend.front`: the call ring's hand-off without Python);
- ``shm_inline`` / ``shm_thread``: the same on the Python backend alone
  (``SHMTRAIN_PG_FRONT=0``), on the caller's thread and with the group's reduction thread;
- ``barrier_front`` / ``barrier_inline``: ``dist.barrier`` through the front and on the
  Python backend;
- ``gloo``: ``dist.all_reduce`` on gloo between the same 2 processes.

The 2-process rows are the slowest rank's figure (a barrier of the host's control block
before each call is not timed). The table and ``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def per_call(fn, reps: int, rounds: int = 5) -> float:
    """The floor: the least over ``rounds`` of the mean seconds per call of ``reps`` calls
    of ``fn`` (the round the machine's other jobs disturbed least)."""
    fn()
    means = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        means.append((time.perf_counter() - start) / reps)
    return min(means)


def _nothing_backend() -> Any:
    from torch._C._distributed_c10d import Backend

    from shmtrain.backend.work import ShmWork

    class Nothing(Backend):
        def __init__(self, store: Any, rank: int, size: int, timeout: Any) -> None:
            super().__init__(rank, size)

        def getBackendName(self) -> str:  # noqa: N802 - c10d's name
            return "nothing"

        def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
            return ShmWork(tensors, pending=False)

    return Nothing


def one_process(nbytes: int, reps: int) -> dict[str, float]:
    """The floors that need no peer (module docstring)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    t = torch.ones(nbytes // 4)
    out: dict[str, float] = {}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    out["dispatch_cpp"] = per_call(lambda: dist.all_reduce(t), reps)
    dist.destroy_process_group()
    if "nothing" not in dist.Backend.backend_list:
        nothing = _nothing_backend()
        dist.Backend.register_backend("nothing", lambda o, b=None: nothing(o.store, o.group_rank, o.group_size,
                                                                           o.timeout),
                                      extended_api=True, devices=["cpu"])
    dist.init_process_group("nothing", store=dist.HashStore(), rank=0, world_size=1)
    out["dispatch_python"] = per_call(lambda: dist.all_reduce(t), reps)
    dist.destroy_process_group()
    jobs: queue.SimpleQueue = queue.SimpleQueue()

    def serve() -> None:
        while (job := jobs.get()) is not None:
            job.set()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def hand_off() -> None:
        done = threading.Event()
        jobs.put(done)
        done.wait()

    out["thread_handoff"] = per_call(hand_off, reps)
    jobs.put(None)
    thread.join()
    dst = torch.empty_like(t)
    out["copy"] = per_call(lambda: dst.copy_(t), reps)
    return out


def _rank(rank: int, port: int, nbytes: int, reps: int, out: str) -> None:
    """One of the 2 processes of the rows that need a peer."""
    import shmtrain  # noqa: F401 - registers the "shm" backend
    from shmtrain.backend import ShmBackend, shm_backend
    from shmtrain.backend import front as front_module

    t = torch.full((nbytes // 4,), float(rank + 1))
    rows: dict[str, float] = {}
    for name, thread, front in (("shm_front", "0", "1"), ("shm_inline", "0", "0"), ("shm_thread", "1", "0")):
        os.environ["SHMTRAIN_PG_THREAD"], os.environ["SHMTRAIN_PG_FRONT"] = thread, front
        dist.init_process_group("cpu:shm", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=60))
        backend = shm_backend()
        assert isinstance(backend, ShmBackend)
        gate = backend.reducer.gate
        assert (gate is not None) == (front == "1"), f"the C++ front is missing: {front_module.why_not}"
        before = ShmBackend.reductions
        rows[name] = _slowest(per_call(lambda: dist.all_reduce(t), reps))
        assert ShmBackend.reductions > before, "the allreduce did not go through shared memory"
        if front == "1":
            assert gate.fast >= reps, "the C++ front did not take the calls"
        if thread == "0":
            rows["barrier_" + name.split("_")[1]] = _slowest(per_call(dist.barrier, reps))
        if name == "shm_inline":
            rows.update(_layers(backend, t, reps))
        dist.destroy_process_group()
        port += 1
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


def _layers(backend: Any, t: torch.Tensor, reps: int) -> dict[str, float]:
    """The backend's own layers between the 2 processes (module docstring)."""
    reducer = backend.reducer

    def headers() -> None:  # a call's header hand-off alone (a large call's begin)
        reducer.begin("all_reduce", t.numel(), t.dtype, "SUM", 1)

    def carried() -> None:  # the hand-off with the data, and the sum (a small all_reduce's begin)
        reducer.begin("all_reduce", t.numel(), t.dtype, "SUM", 1, payload=t, total=t)

    return {"backend_call": _slowest(per_call(lambda: backend.allreduce([t]).wait(), reps)),
            "headers": _slowest(per_call(headers, reps)),
            "carried": _slowest(per_call(carried, reps)),
            "pipeline": _slowest(per_call(lambda: reducer.pipeline(t), reps)),
            "gloo": _slowest(per_call(lambda: backend.gloo.allreduce([t]).wait(), reps))}


def _slowest(seconds: float) -> float:
    """The slowest rank's figure (through the default group: a gloo or shm allreduce MAX)."""
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def two_processes(nbytes: int, reps: int) -> dict[str, float]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="shmtrain-floors-") as tmp:
        out = os.path.join(tmp, "rows.json")
        port = _free_ports()
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, "-m", "shmtrain.bench.floors", "--rank", str(r), "--port",
                                   str(port), "--bytes", str(nbytes), "--reps", str(reps), "--json", out], env=env)
                 for r in range(2)]
        codes = [p.wait(timeout=600) for p in procs]
        if any(codes):
            raise RuntimeError(f"the 2 ranks of bench floors failed (exit codes {codes})")
        with open(out) as f:
            return json.load(f)


def _free_ports(count: int = 3) -> int:
    """A loopback port whose next ``count - 1`` are free too (the groups, one after the other)."""
    import socket

    while True:
        with contextlib.ExitStack() as stack:
            first = stack.enter_context(socket.socket())
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                for k in range(1, count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port + k))
            except OSError:
                continue
            return port


LABELS = {
    "dispatch_cpp": "torch's dispatch into a C++ backend (fake)",
    "dispatch_python": "torch's dispatch into a Python backend + its ShmWork",
    "thread_handoff": "a hand-off to a thread and back",
    "copy": "copy_ of the tensor",
    "headers": "the call header's hand-off alone (2 processes)",
    "carried": "the hand-off carrying the tensor, and its sum",
    "pipeline": "the pipelined allreduce (2 processes)",
    "backend_call": "ShmBackend.allreduce(...).wait(), no torch dispatch",
    "shm_front": "dist.all_reduce on cpu:shm, through its C++ front",
    "shm_inline": "dist.all_reduce on cpu:shm, Python backend, caller's thread",
    "shm_thread": "dist.all_reduce on cpu:shm, Python backend, reduction thread",
    "barrier_front": "dist.barrier on cpu:shm, through its C++ front",
    "barrier_inline": "dist.barrier on cpu:shm, Python backend",
    "gloo": "gloo's allreduce (2 processes)",
}


def run(nbytes: int, reps: int) -> dict[str, float]:
    """Every floor (module docstring), in seconds per call."""
    return {**one_process(nbytes, reps), **two_processes(nbytes, reps)}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("floors", help="per-call floors of a small collective, layer by layer",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--bytes", type=int, default=4096, help="tensor size in bytes (float32; default 4096)")
    p.add_argument("--reps", type=int, default=2000, help="calls per timed round (5 rounds; default 2000)")
    p.add_argument("--json", default=None, help="also write the figures here")
    p.set_defaults(handler=lambda a: main_figures(a.bytes, a.reps, a.json))


def main_figures(nbytes: int, reps: int, out: str | None) -> int:
    if nbytes < 4 or nbytes % 4:
        raise ValueError(f"--bytes {nbytes}: must be a positive multiple of 4 (float32 elements); e.g. --bytes 4096")
    figures = run(nbytes, reps)
    print(f"{'layer':55s} {'us per call':>12s}")
    for key, label in LABELS.items():
        print(f"{label:55s} {figures[key] * 1e6:12.2f}")
    if out:
        with open(out, "w") as f:
            json.dump({"bytes": nbytes, "reps": reps, "seconds_per_call": figures}, f, indent=1)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--reps", type=int, required=True)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    _rank(args.rank, args.port, args.bytes, args.reps, args.json)
