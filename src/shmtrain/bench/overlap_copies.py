"""What ``shmtrain bench overlap`` reports beside the modes' times: the peer and the copies.

- ``ddp_gloo``: PyTorch DistributedDataParallel over gloo (25 MB buckets) with the model on
  the benchmark's device: CUDA tensors with ``--device cuda`` (N processes sharing a GPU,
  which NCCL refuses), plain DDP over gloo on the CPU. The peer every staged strategy is
  measured against in the same run.
- the pinned-memory baseline (``--device cuda``): the model's bytes copied device-to-host
  and host-to-device from one page-locked tensor, all workers at once (as their staged
  copies run), timed by CUDA events. The staged copies of a mode (``copy_to_host``,
  ``copy_to_device``) move the same bytes, so ``copy vs pinned`` = (pinned D2H + H2D) /
  (staged D2H + H2D) is the share of pinned speed the staged copies reach. ``n/a`` on the CPU.
- ``registered``: whether the host buffers a staged mode copies to and from were
  page-locked (``cudaHostRegister``), ``K/N`` of them (:meth:`HostStaging.registered`);
  ``n/a`` on the CPU and for modes that stage nothing.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

#: the DDP-over-gloo peer on the benchmark's device (CUDA tensors on a GPU)
DDP_GLOO = "ddp_gloo"
NA = "n/a"


def ddp_gloo_engine(model: torch.nn.Module, optimizer: torch.optim.Optimizer, timer) -> Any:
    """DDP over the default (gloo) group, the model where it is (CUDA or CPU tensors), its
    default 25 MiB buckets."""
    from shmtrain.bench.common import DDPEngine

    return DDPEngine(model, optimizer, timer)


def registered(engine: Any) -> str:
    """``K/N`` host buffers of the engine's staging page-locked; ``n/a`` without one on a GPU."""
    staging = getattr(getattr(engine, "strategy", None), "staging", None)
    return staging.registered() if staging is not None else NA


def pinned_baseline(numel: int, device: torch.device, barrier: Callable[[], Any],
                    reps: int = 5) -> dict[str, Any]:
    """Median ms of one D2H and one H2D copy of ``numel`` float32 between the device and
    a pinned host tensor (every worker at once, after ``barrier``); ``n/a`` off a GPU."""
    if device.type != "cuda":
        return {"pinned_d2h_ms": NA, "pinned_h2d_ms": NA}
    host = torch.empty(numel, pin_memory=True)
    on_device = torch.empty(numel, device=device)
    stream = torch.cuda.current_stream(device)
    times: dict[str, list[float]] = {"pinned_d2h_ms": [], "pinned_h2d_ms": []}
    for _ in range(reps + 1):  # the first, untimed, warms the copy engines
        for key, dst, src in (("pinned_d2h_ms", host, on_device), ("pinned_h2d_ms", on_device, host)):
            torch.cuda.synchronize(device)
            barrier()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
            end.synchronize()
            times[key].append(begin.elapsed_time(end))
    return {key: statistics.median(values[1:]) for key, values in times.items()}


def add_copy_columns(row: dict[str, Any], baselines: list[dict[str, Any]]) -> None:
    """The row's pinned baseline (the workers' mean) and ``copy_vs_pinned``."""
    for key in ("pinned_d2h_ms", "pinned_h2d_ms"):
        values = [b[key] for b in baselines]
        row[key] = NA if NA in values else statistics.fmean(values)
    staged = 1e3 * (row["phases_s"].get("copy_to_host", 0.0) + row["phases_s"].get("copy_to_device", 0.0))
    if row["pinned_d2h_ms"] == NA or not staged:
        row["copy_vs_pinned"] = NA if row["pinned_d2h_ms"] == NA else None
    else:
        row["copy_vs_pinned"] = (row["pinned_d2h_ms"] + row["pinned_h2d_ms"]) / staged


def cells(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """``rows`` with the ``columns``' values as text (``n/a`` as it is, numbers formatted),
    for :func:`shmtrain.bench.common.table` with the format ``s``."""
    def text(value: Any, fmt: str) -> str | None:
        return value if value is None or isinstance(value, str) else format(value, fmt)

    return [{key: text(row.get(key), fmt) for key, _, fmt in columns} for row in rows]
