"""Helpers shared by the benchmarks: timing across ranks, tables, JSON."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def timed_collective(fn: Callable[[], Any], reps: int, warmup: int, before: Callable[[], Any] | None = None,
                     barrier: Callable[[], Any] | None = None) -> list[float]:
    """Time ``fn`` ``reps`` times after ``warmup``; each sample is the slowest rank's time.

    The per-rank times are combined once at the end (one MAX allreduce of the vector),
    not after every repetition: a gloo collective between repetitions leaves the ranks
    out of step by its own wake-up latency and that skew would be timed as the next
    repetition's (measured: 24 us vs 60 us for a 64 KiB shared-memory allreduce)."""
    local = []
    for i in range(warmup + reps):
        if before is not None:
            before()
        (barrier or dist.barrier)()
        start = time.perf_counter()
        fn()
        if i >= warmup:
            local.append(time.perf_counter() - start)
    samples = torch.tensor(local, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(samples, op=dist.ReduceOp.MAX)
    return samples.tolist()


def timed_rounds(fn: Callable[[int], Any], reps: int, samples: int, barrier: Callable[[], Any],
                 slowest: Callable[[float], float]) -> list[float]:
    """``samples`` timed rounds (after one warm-up round) of ``fn(i)`` for i in range(reps),
    a barrier before each; each round's time is ``slowest`` of the ranks' (the buffer
    service benchmarks: ShmCaffe Fig. 7's bandwidth over a round of operations)."""
    times = []
    for sample in range(samples + 1):
        barrier()
        start = time.perf_counter()
        for i in range(reps):
            fn(i)
        elapsed = slowest(time.perf_counter() - start)
        if sample:
            times.append(elapsed)
    return times


def bench_buffers(service, numel: int) -> tuple[Any, Any]:
    """The buffer-service benchmarks' buffers: one shared by all (rank 0 creates it) and one
    of this worker's own, on ``service`` (local or remote: the same SMB API); ready."""
    shared = service.attach(service.create("bench.global", numel)) if service.rank == 0 else None
    own = service.attach(service.create(f"bench.{service.rank}", numel))
    if shared is None:
        shared = service.attach(service.lookup("bench.global"))
    service.ready()
    return shared, own


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def copy_bandwidth(nbytes: int = 256 << 20, reps: int = 5) -> float:
    """Aggregate copy bandwidth (bytes read + written per second) of all ranks copying
    at once: the memory-traffic floor of this host."""
    n = nbytes // 4
    src = torch.ones(n)
    dst = torch.empty(n)
    samples = timed_collective(lambda: dst.copy_(src), reps, 1)
    world = dist.get_world_size() if dist.is_initialized() else 1
    return 2 * nbytes * world / median(samples)


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """Format ``rows`` with ``columns`` = [(key, header, format)]."""
    widths = [max(len(h), 10) for _, h, _ in columns]
    out = ["  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths, strict=True))]
    for row in rows:
        cells = []
        for (key, _, fmt), w in zip(columns, widths, strict=True):
            value = row.get(key)
            cells.append(("-" if value is None else format(value, fmt)).rjust(w))
        out.append("  ".join(cells))
    return "\n".join(out)


def write_json(path: str | None, rows: list[dict[str, Any]]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(rows, indent=2) + "\n")


def parse_size(text: str) -> int:
    """``"64MiB"``, ``"1MB"``, ``"4096"`` -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    lower = text.strip().lower()
    number, factor = lower, 1
    for suffix, scale in units.items():
        if lower.endswith(suffix):
            number, factor = lower[: -len(suffix)], scale
            break
    try:
        value = int(float(number) * factor)
    except ValueError:
        raise ValueError(f"size {text!r} is not a number with an optional unit (e.g. 64MiB)") from None
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value


#: benchmark modes that are torch DistributedDataParallel: over gloo, with
#: :func:`shmtrain.ddp_comm_hook` (buckets averaged through the host's shared memory), on
#: the ``shm`` torch.distributed backend (:mod:`shmtrain.backend`, unchanged DDP), and with
#: a hook that communicates nothing (``ddp-noop``: DDP's own bucketing, the floor of any
#: DDP backend; its replicas drift apart, so it is for timing only)
DDP_MODES = ("ddp", "ddp-shm", "ddp-backend", "ddp-noop")


def _noop_hook(state: Any, bucket: Any) -> torch.futures.Future:
    """A DDP comm hook that returns the bucket as it is (no communication)."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


# DDP's register_comm_hook compares the annotations with the real types, not strings
# (this module has ``from __future__ import annotations``)
_noop_hook.__annotations__ = {"state": Any, "bucket": dist.GradBucket,
                              "return": torch.futures.Future[torch.Tensor]}


class DDPEngine:
    """PyTorch DistributedDataParallel with the three calls :class:`Trainer` drives, so the
    benchmarks time DDP with the same loop body as every strategy (``update`` timed;
    DDP's allreduce overlaps backward and is awaited inside it). With ``ctx``, the
    buckets go through :func:`shmtrain.parallel.comm_hook.ddp_comm_hook` on that context's host
    instead of gloo; with ``backend``, DDP runs unchanged on a group
    of the ``shm`` backend."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, timer, ctx=None,
                 *, backend: bool = False, noop: bool = False) -> None:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        import shmtrain  # noqa: F401 - registers the "shm" backend

        self.group = dist.new_group(backend="shm") if backend else None
        self.net = DistributedDataParallel(model, process_group=self.group)
        self.optimizer = optimizer
        self.timer = timer
        self.state = None
        if ctx is not None:
            from shmtrain.parallel.comm_hook import ShmHookState, ddp_comm_hook

            self.state = ShmHookState(ctx)
            self.net.register_comm_hook(self.state, ddp_comm_hook)
        elif noop:
            self.net.register_comm_hook(None, _noop_hook)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def __call__(self, *args: Any) -> torch.Tensor:
        return self.net(*args)

    def step(self) -> None:
        with self.timer.phase("update"):
            self.optimizer.step()

    def close(self) -> None:
        """Release the hook's shared buffers or the backend's group, if any (for symmetry
        with DataParallel)."""
        if self.state is not None:
            self.state.close()
        if self.group is not None:  # (torch's destroy_process_group needs a group name that
            self.group.shutdown()  # torch does not give a Python group made by new_group)
            self.group = None


def build_engine(mode: str, ctx, model: torch.nn.Module, optimizer: torch.optim.Optimizer, timer,
                 strategy: str | None = None, options: dict[str, Any] | None = None):
    """``ddp`` -> :class:`DDPEngine` over gloo, ``ddp-shm`` -> with the shared-memory hook;
    otherwise ``DataParallel`` with ``strategy`` and ``options`` (each benchmark mode is
    one of these)."""
    if mode in DDP_MODES:
        return DDPEngine(model, optimizer, timer, ctx if mode == "ddp-shm" else None,
                         backend=mode == "ddp-backend", noop=mode == "ddp-noop")
    from shmtrain.parallel.data_parallel import DataParallel

    return DataParallel(model, optimizer, strategy, ctx=ctx, timer=timer, **(options or {}))


def bench_device(value: str, cpu_modes: list[str], cuda_modes: list[str],
                 given: list[str] | None) -> tuple[str, list[str]]:
    """A benchmark's ``--device`` (checked, ``auto`` resolved) and its modes: ``given``, or
    the defaults of the device. The DDP modes run gloo on host tensors: refused on a GPU."""
    from shmtrain.runtime.train.device import cuda_count, resolve_device

    resolve_device(value)
    cuda = value != "cpu" and (value != "auto" or cuda_count() > 0)
    modes = given or (cuda_modes if cuda else cpu_modes)
    if cuda and set(modes) & set(DDP_MODES):
        raise ValueError(f"--modes {' '.join(sorted(set(modes) & set(DDP_MODES)))} with --device {value}: "
                         "DDP on GPUs needs NCCL, one GPU per worker; use the mode ssgd_nccl instead")
    return ("cuda" if value == "auto" else value) if cuda else "cpu", modes


def worker_setup(device_value: str, local_rank: int) -> tuple[torch.device, Callable[[], Any]]:
    """In a benchmark worker: its device (``runtime/device.worker_device``) and what ends an
    iteration's timing there (a device synchronization on a GPU: its queued work is part
    of the iteration)."""
    from shmtrain.runtime.train.device import worker_device

    device = worker_device(device_value, local_rank)
    return device, (torch.cuda.synchronize if device.type == "cuda" else (lambda: None))


def synthetic_setup(model_name: str, input_shape: str, batch_size: int, rank: int):
    """The benchmarks' worker set-up: the model (seed 0, same on every rank), this rank's
    synthetic batch, and SGD with momentum. Returns ``(model, x, y, optimizer)``."""
    from shmtrain.models import build_model
    from shmtrain.runtime.data.tensors import parse_shape

    shape = parse_shape(input_shape)
    torch.manual_seed(0)
    model = build_model(model_name, shape, 10)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn((batch_size, *shape), generator=gen)
    y = torch.randint(0, 10, (batch_size,), generator=gen)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return model, x, y, optimizer
