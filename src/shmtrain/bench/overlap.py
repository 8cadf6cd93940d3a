"""``shmtrain bench overlap``: overlapped strategies, DDP and no communication, interleaved.

``shmtrain bench step`` runs one launch per mode, one after the other; on a shared,
noisy machine the load then differs between modes. This benchmark builds every mode in
the same worker processes (one model copy each, same seed, same batch) and runs them in
rounds, one iteration of each mode per round, in an order rotated every round, with a
host barrier (untimed) before each iteration. A sample is the slowest worker's
iteration time (the pace of a synchronous job); a row gives the median over rounds,
the ratio to ``nocomm`` (of the medians, and paired: the median over rounds of the
ratio to the same round's ``nocomm`` iteration), the ``collect_remaining`` share of the iteration (TRL's
"collect remaining", CaffeGPI's finalization, DDP's final wait), and the CPU seconds a
worker process (all its threads) used per iteration, which other jobs move far less.

With ``--device cuda`` the workers compute on GPUs (``cuda:N``: all on GPU N,
sharing it) and their buffers stay in host memory: each iteration ends with a device
synchronization before its time is taken, forward/backward/update are timed by CUDA
events, and the rows add the staged copies (TRL Table 4): ``copy_to_host`` and
``copy_to_device`` (their device time, CUDA events on the copy streams), ``d2h_wait``
(what the training thread still waited for the copies to host after backward) and
``hidden`` = 1 - d2h_wait / copy_to_host, the share of the copies to host that backward
hid (for ``cpu_acc``, whose copies are waited for by its accumulator thread, all of
``collect_remaining`` counts as left after backward: an upper bound). A mode named ``MODE@copy`` (e.g. ``ssgd@copy``)
runs that mode's staged
path on the CPU (``SHMTRAIN_STAGING=copy``): beside ``MODE``, what the copies cost against
zero copy. The DDP modes need NCCL (one GPU per worker) there: use ``ssgd_nccl``, or
``ddp_gloo``: DDP over gloo with the model on the chosen device (CUDA tensors, the workers
sharing a GPU; plain DDP over gloo on the CPU), the peer of the staged strategies. With
``--device cuda`` the copies table adds a pinned-memory baseline (the model's bytes D2H and
H2D from one pinned tensor) and every row says whether its shared buffers were page-locked
(``registered``, ``n/a`` on the CPU): :mod:`shmtrain.bench.overlap_copies`.

Run: ``shmtrain bench overlap --workers 2 --json FILE`` (or ``python -m
shmtrain.bench.overlap``, the same options).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from shmtrain.bench.common import DDP_MODES, bench_device, table, write_json
from shmtrain.bench.overlap_copies import (
    DDP_GLOO,
    add_copy_columns,
    cells,
    ddp_gloo_engine,
    pinned_baseline,
    registered,
)

# mode -> (strategy, options): the same table as ``shmtrain bench step``; ``ddp``, ``ddp-shm`` apart.
from shmtrain.bench.step import MODES
from shmtrain.fabric.job.context import ProcessContext
from shmtrain.runtime.launch.launcher import launch
from shmtrain.strategies.layout.staging import force_copies

DEFAULT_MODES = ["nocomm", "ddp", "gpi", "cpu_acc", "ssgd_overlap"]
#: a mode name ending so runs the mode's staged path on the CPU (``SHMTRAIN_STAGING=copy``
#: while its engine is built): what the GPU data flow's copies cost against zero copy
STAGED = "@copy"
#: ``--device cuda``: the host-staged strategies against no communication
CUDA_MODES = ["nocomm", DDP_GLOO, "ssgd", "gpi", "cpu_acc", "ssgd_overlap", "ps_grad"]
#: this benchmark's strategy modes: ``bench step``'s and the gradient parameter server
OVERLAP_MODES = {**MODES, "ps_grad": ("ps_grad", {})}


def check_modes(modes: list[str]) -> None:
    """Reject a ``--modes`` name that is none of this benchmark's (``MODE@copy`` allowed)."""
    known = [*DDP_MODES, DDP_GLOO, *OVERLAP_MODES]
    unknown = [m for m in modes if m not in known and m.removesuffix(STAGED) not in OVERLAP_MODES]
    if unknown:
        raise ValueError(f"--modes {' '.join(unknown)}: unknown; choose from {', '.join(known)} "
                         f"(a strategy mode may end in {STAGED})")


def overlap_worker(ctx: ProcessContext, payload: dict[str, Any]) -> dict[str, Any]:
    from shmtrain.bench.common import build_engine, worker_setup
    from shmtrain.models import build_model
    from shmtrain.runtime.data.tensors import parse_shape
    from shmtrain.runtime.train.trainer import Trainer
    from shmtrain.timing import PhaseTimer

    device, sync = worker_setup(payload.get("device", "cpu"), ctx.local_rank)
    shape = parse_shape(payload["input_shape"])
    gen = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn((payload["batch_size"], *shape), generator=gen).to(device)
    y = torch.randint(0, 10, (payload["batch_size"],), generator=gen).to(device)
    loss_fn = nn.CrossEntropyLoss()
    steps, timers, closers, locked = {}, {}, [], {}
    for mode in payload["modes"]:
        torch.manual_seed(0)
        model = build_model(payload["model"], shape, 10).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        timer = timers[mode] = PhaseTimer(device)
        spec = payload["specs"].get(mode, (None, None))
        if mode == DDP_GLOO:
            engine = ddp_gloo_engine(model, optimizer, timer)
        else:
            with force_copies() if mode.endswith(STAGED) else nullcontext():  # MODE@copy: staged on the CPU
                engine = build_engine(mode, ctx, model, optimizer, timer, *spec)
        closers.append(engine.close)
        locked[mode] = registered(engine)
        trainer = Trainer(engine, loss_fn, timer)

        def step(trainer=trainer) -> None:
            trainer.step(x, y)

        steps[mode] = step
    samples: dict[str, list[float]] = {m: [] for m in steps}
    cpu: dict[str, list[float]] = {m: [] for m in steps}
    faults: dict[str, list[int]] = {m: [] for m in steps}
    layers: dict[str, list[list[dict[str, Any]]]] = {}
    phases: dict[str, list[dict[str, float]]] = {m: [] for m in steps}
    modes = list(steps)
    for rnd in range(payload["warmup"] + payload["rounds"]):
        shift = rnd % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            ctx.host.barrier(f"bench overlap {mode}")
            start, start_cpu = time.perf_counter(), time.process_time()
            start_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            steps[mode]()
            sync()  # a GPU's queued work is part of the iteration
            elapsed, used = time.perf_counter() - start, time.process_time() - start_cpu
            faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start_faults
            record = timers[mode].finish_iteration()
            details = timers[mode].take_details()
            if rnd >= payload["warmup"]:
                samples[mode].append(elapsed)
                cpu[mode].append(used)
                faults[mode].append(faulted)
                phases[mode].append(record)
                if "layers" in details:
                    layers.setdefault(mode, []).append(details["layers"])
    for close in closers:
        close()
    numel = sum(p.numel() for p in model.parameters())
    baseline = pinned_baseline(numel, device, lambda: ctx.host.barrier("bench overlap pinned"))
    return {"samples": samples, "cpu": cpu, "faults": faults, "phases": phases, "layers": layers,
            "registered": locked, "pinned": baseline}


def run(modes: list[str], workers: int, payload: dict[str, Any],
        specs: dict[str, tuple[str, dict[str, Any]]] | None = None) -> list[dict[str, Any]]:
    """Run ``modes`` (names in ``specs``, default :data:`MODES`, or in ``DDP_MODES``) in one launch."""
    specs = {m: (specs or OVERLAP_MODES)[m.removesuffix(STAGED)] for m in modes
             if m not in DDP_MODES and m != DDP_GLOO}
    results = launch("shmtrain.bench.overlap:overlap_worker", workers, dict(payload, modes=modes, specs=specs),
                     threads=payload["threads"], timeout=payload.get("timeout", 600))
    rows = []
    for mode in modes:
        per_round = [max(r["samples"][mode][i] for r in results) for i in range(payload["rounds"])]
        cpu_round = [statistics.fmean(r["cpu"][mode][i] for r in results) for i in range(payload["rounds"])]
        names = sorted({k for r in results for p in r["phases"][mode] for k in p})
        mean = {k: statistics.fmean(p.get(k, 0.0) for r in results for p in r["phases"][mode]) for k in names}
        rows.append({
            "mode": mode, "workers": workers, "model": payload["model"], "batch_size": payload["batch_size"],
            "threads": payload["threads"], "rounds": payload["rounds"], "device": payload.get("device", "cpu"),
            "median_s": statistics.median(per_round), "min_s": min(per_round), "samples_s": per_round,
            # the host buffers' page-locking, rank 0's (K/N; n/a on the CPU or staging nothing)
            "registered": results[0]["registered"][mode],
            # CPU seconds of a worker process (all its threads) per iteration: unlike wall
            # time, barely moved by other jobs on the machine
            "cpu_s": statistics.median(cpu_round), "cpu_samples_s": cpu_round,
            "phases_s": mean,
            # minor page faults of a worker process per iteration (fresh memory touched)
            "page_faults": statistics.median(f for r in results for f in r["faults"][mode]),
            # median, not mean: one stalled iteration must not stand for the typical one
            "collect_remaining_median_s": statistics.median(
                p["collect_remaining"] for r in results for p in r["phases"][mode]
            ) if "collect_remaining" in mean else None,
        })
        per_layer = [it for r in results for it in r["layers"].get(mode, [])]
        if per_layer:
            rows[-1]["layers"] = layer_medians(per_layer)
    base = next((r for r in rows if r["mode"] == "nocomm"), None)
    for row in rows:
        row["vs_nocomm"] = row["median_s"] / base["median_s"] if base else None
        row["cpu_vs_nocomm"] = row["cpu_s"] / base["cpu_s"] if base else None
        # paired: the ratio to the nocomm iteration of the same round (seconds apart), so
        # load that drifts over the run cancels; the median over rounds
        row["paired_vs_nocomm"] = statistics.median(
            a / b for a, b in zip(row["samples_s"], base["samples_s"], strict=True)) if base else None
        row["paired_cpu_vs_nocomm"] = statistics.median(
            a / b for a, b in zip(row["cpu_samples_s"], base["cpu_samples_s"], strict=True)) if base else None
        remaining = row.pop("collect_remaining_median_s")
        row["collect_remaining_share"] = remaining / row["median_s"] if remaining is not None else None
        copies = row["phases_s"].get("copy_to_host")
        row["hidden"] = 1 - row["phases_s"].get("d2h_wait", 0.0) / copies if copies else None
        add_copy_columns(row, [r["pinned"] for r in results])
    return rows


def _handler(args: argparse.Namespace) -> int:
    device, modes = bench_device(args.device, DEFAULT_MODES, CUDA_MODES, args.modes)
    check_modes(modes)
    if args.workers < 1 or args.rounds < 1 or args.warmup < 0 or args.batch_size < 1 or args.threads < 1:
        raise ValueError("--workers, --rounds, --batch-size and --threads must be at least 1 and --warmup not negative")
    payload = {"model": args.model, "input_shape": args.input_shape, "batch_size": args.batch_size,
               "rounds": args.rounds, "warmup": args.warmup, "threads": args.threads,
               "device": device}
    rows = run(modes, args.workers, payload)
    print(format_tables(rows, payload["device"]))
    for row in rows:
        if "layers" in row:  # TRL Table 4: per-layer copy and accumulation times (ms)
            print(f"\n{row['mode']}: per-layer medians in ms, backward order")
            print(table(row["layers"], [("layer", "layer", "s"), ("numel", "numel", "d"),
                                        ("copy_ms", "copy", ".3f"), ("lock_wait_ms", "lock wait", ".3f"),
                                        ("accumulate_ms", "accumulate", ".3f"), ("copy_back_ms", "back", ".3f")]))
    write_json(args.json, rows)
    return 0


MAIN_COLUMNS = [("workers", "workers", "d"), ("mode", "mode", "s"), ("median_s", "median s", ".4f"),
                ("min_s", "min s", ".4f"), ("vs_nocomm", "vs nocomm", ".3f"), ("paired_vs_nocomm", "paired", ".3f"),
                ("collect_remaining_share", "remaining", ".2%"), ("cpu_s", "cpu s", ".4f"),
                ("paired_cpu_vs_nocomm", "cpu paired", ".3f"), ("page_faults", "faults", ".0f"),
                ("registered", "registered", "s")]
COPY_COLUMNS = [("mode", "mode", "s"), ("copy_to_host_ms", "to host ms", ".2f"),
                ("copy_to_device_ms", "to device ms", ".2f"), ("d2h_wait_ms", "left after backward ms", ".2f"),
                ("hidden", "hidden", ".1%"), ("pinned_d2h_ms", "pinned D2H ms", ".2f"),
                ("pinned_h2d_ms", "pinned H2D ms", ".2f"), ("copy_vs_pinned", "copy vs pinned", ".1%"),
                ("registered", "registered", "s")]


def format_tables(rows: list[dict[str, Any]], device: str) -> str:
    """The main table, and where a mode staged copies (a GPU, or ``MODE@copy``) the copies
    beside the pinned baseline (TRL Table 4); adds the ``*_ms`` copy keys to ``rows``."""
    text = table(cells(rows, MAIN_COLUMNS), [(k, h, "s") for k, h, _ in MAIN_COLUMNS])
    if any(row["hidden"] is not None for row in rows):
        for row in rows:
            row.update({f"{k}_ms": 1e3 * row["phases_s"].get(k, 0.0)
                        for k in ("copy_to_host", "copy_to_device", "d2h_wait")})
        text += (f"\n\nstaged copies per iteration on {device} (device time by CUDA events on a GPU, "
                 "host clocks with SHMTRAIN_STAGING=copy; cpu_acc: all of collect_remaining counts as left; "
                 "pinned: the model's bytes from one pinned tensor, all workers at once)\n")
        text += table(cells(rows, COPY_COLUMNS), [(k, h, "s") for k, h, _ in COPY_COLUMNS])
    return text


def layer_medians(iterations: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Median over iterations and workers of each layer's times, in milliseconds."""
    order = [entry["layer"] for entry in iterations[0]]
    by_layer: dict[str, list[dict[str, Any]]] = {}
    for iteration in iterations:
        for entry in iteration:
            by_layer.setdefault(entry["layer"], []).append(entry)
    return [
        {"layer": name, "numel": by_layer[name][0]["numel"], **{
            key[:-2] + "_ms": 1e3 * statistics.median(e[key] for e in by_layer[name])
            for key in ("copy_s", "lock_wait_s", "accumulate_s", "copy_back_s")
        }}
        for name in order
    ]


def add_bench_overlap_parser(bench: argparse._SubParsersAction) -> None:
    """Register ``shmtrain bench overlap``."""
    p = bench.add_parser("overlap", help="overlapped strategies vs DDP vs no communication, interleaved",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _arguments(p)
    p.set_defaults(handler=_handler)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="resnet18", help="model name (default resnet18)")
    p.add_argument("--input-shape", default="3x64x64", help="CxHxW of the synthetic batch (default 3x64x64)")
    p.add_argument("--batch-size", type=int, default=32, help="per worker (default 32)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--modes", nargs="+", help=f"default: {' '.join(DEFAULT_MODES)}")
    p.add_argument("--rounds", type=int, default=15, help="timed rounds, one iteration of each mode (default 15)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda (worker r on GPU r mod the count), "
                   "cuda:N (every worker on GPU N) or auto; on a GPU the default modes are "
                   f"{' '.join(CUDA_MODES)}")
    p.add_argument("--json", help="write the rows here")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m shmtrain.bench.overlap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _arguments(parser)
    raise SystemExit(_handler(parser.parse_args()))
