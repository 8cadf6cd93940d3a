"""Run ``shmtrain train``: start local workers, or be one worker of a torchrun job."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from shmtrain import strategies
from shmtrain.runtime import report
from shmtrain.runtime.config import TrainConfig, to_toml
from shmtrain.runtime.launcher import WorkerFailed, launch
from shmtrain.runtime.preflight import preflight

TARGET = "shmtrain.runtime.loop:train_worker"


def under_torchrun() -> bool:
    """True when torchrun (or another launcher with its environment) started us."""
    return "SHMTRAIN_STORE_PORT" not in os.environ and (
        "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
    )


def default_out(config: TrainConfig) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{config.strategy}"


def run_training(config: TrainConfig, echo=print) -> dict[str, Any] | None:
    """Train as ``config`` says; return the summary (None on non-zero ranks of torchrun)."""
    if under_torchrun():
        return _run_torchrun(config, echo)
    out = Path(config.out) if config.out else default_out(config)
    preflight(config, out)  # before any folder or worker: one clear line, exit 2
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(to_toml(config))
    echo(f"shmtrain: {config.strategy}, {config.workers} workers x {config.threads} thread(s), "
         f"{config.model} on {config.data}; run folder {out}")
    start = time.perf_counter()
    try:
        results = launch(TARGET, config.workers, {"config": config, "out": str(out)},
                         threads=config.threads, timeout=config.timeout,
                         tolerate_worker_loss=strategies.get(config.strategy).tolerates_peer_loss)
    except WorkerFailed as exc:
        if exc.results and 0 in exc.results:
            # An asynchronous run lost a worker and the others trained to the end:
            # report what they did, then fail so the exit status says a worker died.
            _finish(out, config, list(exc.results.values()), time.perf_counter() - start, echo)
        raise
    return _finish(out, config, results, time.perf_counter() - start, echo)


def _finish(out: Path, config: TrainConfig, results: list[dict[str, Any]], wall: float, echo) -> dict[str, Any]:
    summary = report.summarize(out, config.to_dict(), results, wall)
    echo("\nTime per iteration (mean over workers and iterations):")
    echo(report.breakdown_table({k: v / 1e3 for k, v in summary["phases_ms"].items()}))
    for line in strategies.get(config.strategy).describe_metrics(summary):
        echo(line)
    acc = summary["accuracy"]
    echo(f"\nheld-out accuracy {acc * 100:.2f}%  |  {summary['iterations']} iterations  |  "
         f"wall {wall:.1f} s  |  {out}/summary.json, {out}/plot.png")
    return summary


def _run_torchrun(config: TrainConfig, echo) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    from shmtrain.fabric.context import from_env
    from shmtrain.runtime.loop import train_worker

    torch.set_num_threads(config.threads)
    start = time.perf_counter()
    ctx = from_env(config.timeout)
    try:
        if ctx.rank == 0:
            out = Path(config.out) if config.out else default_out(config)
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.toml").write_text(to_toml(config))
            ctx.store.set("out", str(out.resolve()))
        out = Path(ctx.store.get("out").decode())
        config.workers = ctx.world_size
        result = train_worker(ctx, {"config": config, "out": str(out)})
        results: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(results, result)
    except BaseException:
        ctx.fail()
        raise
    finally:
        ctx.close()
    if ctx.rank != 0:
        return None
    return _finish(out, config, results, time.perf_counter() - start, echo)
