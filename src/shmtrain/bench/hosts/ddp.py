"""The PyTorch DDP baseline of ``shmtrain bench hosts``: one torchrun worker, flat DDP over gloo.

The baseline of the time-to-accuracy comparison (ShmCaffe Table II, Figs. 8-12, where
the baseline is Caffe-MPI's flat allreduce) across two hosts.

Run under torchrun, one process per worker, with the flags of ``shmtrain train`` that
matter here (``--model``, ``--data``, ``--batch-size``, ``--lr``, ``--momentum``,
``--weight-decay``, ``--iterations``, ``--seed``, ``--eval-every``, ``--timeout``,
``--out``)::

    torchrun --nnodes 2 --nproc-per-node 2 ... -m shmtrain.bench.hosts.ddp --model wide_mlp --out DIR

It trains exactly what ``shmtrain train`` trains with the same flags, from the
project's own pieces: the model (:func:`shmtrain.models.build_model`, seeded by
``--seed``), the data and its sharding (:mod:`shmtrain.runtime.data.tensors`: the same
``ShardSampler`` and ``Prefetcher``), SGD with the same momentum and weight decay, the
learning-rate schedule, one loop body (:class:`shmtrain.runtime.train.trainer.Trainer`) and
the held-out evaluation on rank 0 (:class:`shmtrain.runtime.run.monitor.Monitor`). Only
the engine differs: :class:`shmtrain.bench.common.DDPEngine` with torch's own
DistributedDataParallel over the default gloo group of all the job's workers (flat:
every bucket is a gloo allreduce among all ranks, no shared memory), the group set up
by :func:`shmtrain.fabric.job.context.from_env` (which picks the interface that routes to
``MASTER_ADDR``, as ``shmtrain train`` does).

Every rank writes ``DIR/metrics/rank-<r>.jsonl`` in ``shmtrain train``'s format (rank 0
with its ``{"eval": ...}`` rows). ``comm`` is the time backward waited for the
gradient allreduce after the last bucket was handed over (DDP overlaps the rest with
backward); it is taken out of ``backward``, so ``compute`` is the same quantity as
for the shmtrain strategies.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class CommTimer:
    """A DDP comm hook (torch's plain allreduce-and-average) that notes, per iteration,
    when the last bucket was handed over and when the last allreduce finished."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.last_call = 0.0
        self.last_done = 0.0

    def reset(self) -> None:
        with self.lock:
            self.last_call = self.last_done = 0.0

    def exposed(self) -> float:
        """Seconds between the last hand-over and the last completion (0 when none)."""
        with self.lock:
            return max(0.0, self.last_done - self.last_call) if self.last_call else 0.0

    # Not annotated: DDP compares the annotations with the real types, and this module's
    # are strings (``from __future__ import annotations``).
    def hook(self, state, bucket):
        """The comm hook: average ``bucket`` over every rank by gloo, noting the times."""
        with self.lock:
            self.last_call = time.perf_counter()
        tensor = bucket.buffer().div_(dist.get_world_size())
        future = dist.all_reduce(tensor, async_op=True).get_future()

        def done(fut: torch.futures.Future) -> torch.Tensor:
            with self.lock:
                self.last_done = max(self.last_done, time.perf_counter())
            return fut.value()[0]

        return future.then(done)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m shmtrain.bench.hosts.ddp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smallcnn")
    p.add_argument("--data", default="digits")
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--iterations", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--class-split", type=int, default=0, help="host k trains on classes c with c mod N == k")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--out", required=True, help="run folder (metrics/rank-<r>.jsonl, summary.json)")
    return p.parse_args(argv)


def train(args: argparse.Namespace) -> dict[str, Any]:
    """This worker's share of the DDP run; rank 0 returns the summary it writes."""
    from shmtrain.bench.common import DDPEngine
    from shmtrain.fabric.job.context import from_env
    from shmtrain.models import build_model
    from shmtrain.runtime.config import resolve
    from shmtrain.runtime.data.class_split import shard_sampler
    from shmtrain.runtime.data.tensors import Prefetcher
    from shmtrain.runtime.outputs.report import phase_means, read_metrics
    from shmtrain.runtime.run.loop import planned_iterations
    from shmtrain.runtime.run.monitor import Monitor
    from shmtrain.runtime.train import schedule
    from shmtrain.runtime.train.trainer import Trainer
    from shmtrain.startup import mark
    from shmtrain.timing import PhaseTimer

    torch.set_num_threads(1)
    mark("imports")
    ctx = from_env(args.timeout)
    out = Path(args.out)
    try:
        config = resolve({"device": "cpu", "model": args.model, "data": args.data, "batch_size": args.batch_size,
                          "lr": args.lr,
                          "momentum": args.momentum, "weight_decay": args.weight_decay,
                          "iterations": args.iterations, "seed": args.seed, "eval_every": args.eval_every,
                          "class_split": args.class_split,
                          "workers": ctx.world_size, "out": str(out), "progress": False})
        torch.manual_seed(config.seed)  # the same order of calls as shmtrain train's worker loop
        data = config.data_config.build().tensors  # digits or synthetic: tensors in memory
        if data is None:
            raise ValueError(f"--data {config.data}: the DDP peer of bench hosts trains on digits or "
                             "synthetic (tensors in memory); choose one of them")
        mark("data")
        model = build_model(config.model, data.input_shape, data.num_classes, config.model_args)
        mark("model")
        optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                                    weight_decay=config.weight_decay)
        timer = PhaseTimer()
        engine = DDPEngine(model, optimizer, timer)  # flat: the default gloo group of every rank
        comm = CommTimer()
        engine.net.register_comm_hook(None, comm.hook)
        mark("strategy")
        total = planned_iterations(config, data, ctx.world_size)
        scheduler = schedule.from_config(optimizer, config, total)
        trainer = Trainer(engine, nn.CrossEntropyLoss(), timer, scheduler=scheduler)
        sampler = shard_sampler(data, config.batch_size, config.seed, ctx, config.class_split)
        prefetch = Prefetcher(data.train_x, data.train_y, sampler, config.prefetch)
        (out / "metrics").mkdir(parents=True, exist_ok=True)
        monitor = Monitor(config, out, ctx.rank, model, data, ctx.world_size)
        mark("first-iteration")
        start = time.perf_counter()
        _iterations(trainer, prefetch, comm, timer, monitor, total, out / "metrics" / f"rank-{ctx.rank}.jsonl")
        wall = time.perf_counter() - start
        prefetch.close()
        engine.close()
        dist.barrier()  # every rank's metrics are written before rank 0 reads them
        summary: dict[str, Any] = {}
        if ctx.rank == 0:
            from shmtrain.runtime.run.loop import accuracy

            summary = {"strategy": "ddp", "workers": ctx.world_size, "iterations": total, "wall_s": wall,
                       "accuracy": accuracy(model, data.test_x, data.test_y),
                       "phases_ms": {k: v * 1e3 for k, v in phase_means(read_metrics(out)).items()}}
            (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        ctx.shutdown()  # every peer done before any gloo pair is torn down
        return summary
    except BaseException:
        ctx.fail()
        raise
    finally:
        ctx.close()

def _iterations(trainer: Any, prefetch: Any, comm: CommTimer, timer: Any, monitor: Any, total: int,
                metrics: Path) -> None:
    """``total`` DDP iterations, each row written to ``metrics`` with the communication DDP
    waited for moved out of backward (its ``comm`` phase)."""
    with open(metrics, "w") as log:
        for iteration in range(1, total + 1):
            iter_start = time.perf_counter()
            with timer.phase("data"):
                x, y = prefetch.next()
            comm.reset()
            loss = trainer.step(x, y)
            phases = timer.finish_iteration()
            waited = min(comm.exposed(), phases.get("backward", 0.0))
            phases["comm"] = waited  # inside backward for DDP: moved out of it
            phases["backward"] = phases.get("backward", 0.0) - waited
            phases["compute"] -= waited
            phases["iteration"] = time.perf_counter() - iter_start
            row = {"iteration": iteration, "loss": float(loss.detach()), "lr": trainer.lr,
                   "t0": monitor.stamp(iter_start), "time": phases}
            log.write(json.dumps(row) + "\n")
            monitor.after_iteration(row, log)
        monitor.finish(total, log)



def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        summary = train(args)
    except ValueError as exc:
        print(f"shmtrain.bench.hosts.ddp: error: {exc}", file=sys.stderr)
        return 2
    if summary:
        print(f"ddp: held-out accuracy {summary['accuracy'] * 100:.2f}%  |  {summary['iterations']} iterations"
              f"  |  wall {summary['wall_s']:.1f} s  |  {args.out}/summary.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
