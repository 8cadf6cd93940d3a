"""swCaffe's cost model held to this machine: calibration and the measured iteration.

alpha and beta are fitted on shmtrain's shared-memory allreduce (a small and a large
buffer; 2 processes with --quick, 2 and 4 otherwise), gamma on a local sum; an ``ssgd``
iteration is predicted as compute + allreduce, once from one worker alone (times
ceil(workers / cores): more workers than cores take turns) and once from the workers
computing at once (``nocomm`` in the same run), and compared with the measured one.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any

import numpy as np

from shmtrain.reproduce.core import Context
from shmtrain.sim.model import CostModel
from shmtrain.sim.simulate import simulate_all


def calibration_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    """One of ``p`` workers: the shared-memory allreduce of each size (sum, each sample the
    slowest rank's time), a local sum of two buffers (gamma), then ``nocomm`` and ``ssgd``
    iterations of the benchmarks' synthetic set-up (:mod:`shmtrain.bench.step`)."""
    import torch
    from torch import nn

    from shmtrain.bench.common import build_engine, median, synthetic_setup, timed_collective
    from shmtrain.fabric.allreduce.shared import ShmAllreduce
    from shmtrain.runtime.train.trainer import Trainer
    from shmtrain.timing import PhaseTimer

    def barrier() -> None:
        ctx.host.barrier("calibration")

    allreduce = {}
    for nbytes in payload["sizes"]:
        ar = ShmAllreduce(ctx.host, nbytes // 4, op="sum", tag=f"calibration{nbytes}")
        reps = payload["reps"] if nbytes < 1 << 20 else max(3, payload["reps"] // 3)
        allreduce[str(nbytes)] = median(timed_collective(ar, reps, 2, before=lambda a=ar: a.input().fill_(1.0),
                                                         barrier=barrier))
        ar.close()
        del ar
    n = payload["sum_bytes"] // 4
    buffers = [torch.ones(n), torch.ones(n)]
    sum_s = median(timed_collective(lambda: buffers[0].add_(buffers[1]), 5, 1, barrier=barrier))
    buffers.clear()
    # nocomm and ssgd iterations alternate (in alternating order), so that a change of
    # the machine's load during the run reaches both alike
    trainers, engines = {}, []
    for mode in ("nocomm", "ssgd"):
        model, x, y, optimizer = synthetic_setup(payload["model"], payload["input_shape"], payload["batch_size"],
                                                 ctx.rank)
        timer = PhaseTimer()
        engines.append(build_engine(mode, ctx, model, optimizer, timer, mode, {}))
        trainers[mode] = (Trainer(engines[-1], nn.CrossEntropyLoss(), timer), x, y)
    steps: dict[str, list[float]] = {mode: [] for mode in trainers}
    barrier()
    for i in range(payload["warmup"] + payload["iterations"]):
        for mode in (("nocomm", "ssgd") if i % 2 else ("ssgd", "nocomm")):
            trainer, x, y = trainers[mode]
            start = time.perf_counter()
            trainer.step(x, y)
            if i >= payload["warmup"]:
                steps[mode].append(time.perf_counter() - start)
            trainer.timer.finish_iteration()
    for engine in engines:
        engine.close()
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"allreduce_s": allreduce, "gamma": sum_s / payload["sum_bytes"], "steps": steps,
            "gradient_bytes": gradient_bytes}


def alone_compute_s(payload: dict[str, Any]) -> float:
    """Median time of one plain training iteration of one worker alone (1 thread), here."""
    import torch
    from torch import nn

    from shmtrain.bench.common import synthetic_setup

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, x, y, optimizer = synthetic_setup(payload["model"], payload["input_shape"], payload["batch_size"], 0)
        loss_fn = nn.CrossEntropyLoss()
        samples = []
        for i in range(payload["warmup"] + payload["iterations"]):
            start = time.perf_counter()
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
            if i >= payload["warmup"]:
                samples.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(samples)


def fit_cost_model(allreduce: dict[int, dict[int, float]], gamma: float, cores: int
                   ) -> tuple[CostModel, list[dict[str, Any]]]:
    """Least squares for alpha and beta (gamma measured apart) over every measured
    (processes, bytes): the regressors are the simulator's steps and bytes sent of the
    ``rhd`` schedule on one host (one group), times :func:`time_share`. With ``rhd`` the
    bytes sent are always twice the bytes reduced, so beta and gamma cannot be told apart
    from allreduce times alone; hence gamma from the local sum. Relative errors are
    minimised, so the small and the large buffer weigh the same. Returns the model and
    the fit's rows (measured and fitted time)."""
    zero = CostModel(alpha=0, beta_inside=0, beta_across=0, gamma=0)
    rows, design, target = [], [], []
    for procs, by_size in sorted(allreduce.items()):
        for nbytes, seconds in sorted(by_size.items()):
            sim = simulate_all(procs, procs, nbytes, zero, ["rhd"])[0]
            share = time_share(procs, cores)
            design.append([share * sim.steps, share * sim.bytes_inside])
            target.append(seconds - share * sim.bytes_reduced * gamma)
            rows.append({"procs": procs, "bytes": nbytes, "measured_s": seconds})
    weights = 1 / np.maximum(np.asarray([r["measured_s"] for r in rows]), 1e-9)
    alpha, beta = _nonnegative_least_squares(np.asarray(design, float) * weights[:, None],
                                             np.asarray(target) * weights)
    model = CostModel(alpha=alpha, beta_inside=beta, beta_across=beta, gamma=gamma)
    for r in rows:
        r["fitted_s"] = predicted_allreduce_s(r["procs"], r["bytes"], model, cores)
    return model, rows


def _nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """min |a x - b| over x >= 0 for two unknowns (the free solution, or one unknown at 0)."""
    candidates = [np.linalg.lstsq(a, b, rcond=None)[0]]
    for j in (0, 1):
        x = np.zeros(2)
        x[j] = max(float(a[:, j] @ b / (a[:, j] @ a[:, j])), 0.0) if a[:, j].any() else 0.0
        candidates.append(x)
    best = min((x for x in candidates if (x >= 0).all()), key=lambda x: float(np.linalg.norm(a @ x - b)))
    return float(best[0]), float(best[1])


def time_share(procs: int, cores: int) -> int:
    """How many workers take turns on one core: every phase, compute and allreduce alike,
    takes this many times longer than with a core per worker."""
    return math.ceil(procs / cores)


def predicted_allreduce_s(procs: int, nbytes: int, model: CostModel, cores: int) -> float:
    """The simulator's ``rhd`` allreduce on one host of ``procs`` workers, time-shared."""
    return time_share(procs, cores) * simulate_all(procs, procs, nbytes, model, ["rhd"])[0].predicted_s


def calibrate(ctx: Context) -> dict[str, Any]:
    """Measure here and predict the ``ssgd`` iteration for 2 workers (and 4 in the full run).

    ResNet-18 (torchvision) on 3x64x64 inputs, 10 classes, batch 16 per worker (44.7 MB
    of gradients). Predicted iteration = compute + the simulator's allreduce (time-shared),
    the compute being (a) one worker alone x :func:`time_share`, measured in this process
    before and after the launches (their mean), or (b) ``nocomm`` iterations of the same
    workers, interleaved with the ``ssgd`` ones. (b) sees the same load as the measurement;
    (a) does not when other programs share the cores."""
    from shmtrain.runtime.launch.launcher import launch

    cores = len(os.sched_getaffinity(0))
    payload = {"model": "resnet18", "input_shape": "3x64x64", "batch_size": 16,
               "sizes": [4096, 16 << 20] if ctx.quick else [4096, 1 << 20, 64 << 20],
               "reps": 12 if ctx.quick else 30, "sum_bytes": 16 << 20,
               "warmup": 1, "iterations": 4 if ctx.quick else 12}
    workers = (2,) if ctx.quick else (2, 4)
    ctx.log(f"swcaffe: compute time of one {payload['model']} worker alone")
    load = [os.getloadavg()[0]]  # other programs on the cores change what (a) predicts
    alone = [alone_compute_s(payload)]
    measured: dict[int, dict[str, Any]] = {}
    for p in workers:
        ctx.log(f"swcaffe: {p} workers: shm allreduce of {payload['sizes']} B, local sum, nocomm and ssgd")
        results = launch("shmtrain.reproduce.swcaffe.calibration:calibration_worker", p, payload, timeout=300)
        measured[p] = {
            "allreduce_s": {int(k): v for k, v in results[0]["allreduce_s"].items()},
            # every rank sums at once; with more ranks than cores they take turns
            "gamma": statistics.median(r["gamma"] for r in results) / time_share(p, cores),
            "nocomm_s": statistics.median(s for r in results for s in r["steps"]["nocomm"]),
            "ssgd_s": statistics.median(s for r in results for s in r["steps"]["ssgd"]),
            "gradient_bytes": results[0]["gradient_bytes"],
        }
    alone.append(alone_compute_s(payload))
    load.append(os.getloadavg()[0])
    compute = statistics.fmean(alone)
    gamma = statistics.median(m["gamma"] for m in measured.values())
    model, fit = fit_cost_model({p: m["allreduce_s"] for p, m in measured.items()}, gamma, cores)
    rows = []
    for p, m in measured.items():
        share = time_share(p, cores)
        allreduce = predicted_allreduce_s(p, m["gradient_bytes"], model, cores)
        from_alone = share * compute + allreduce
        from_concurrent = m["nocomm_s"] + allreduce
        rows.append({"workers": p, "cores": cores, "time_share": share, "compute_alone_s": compute,
                     "compute_concurrent_s": m["nocomm_s"], "predicted_allreduce_s": allreduce,
                     "predicted_from_alone_s": from_alone, "predicted_from_concurrent_s": from_concurrent,
                     "measured_s": m["ssgd_s"], "error_from_alone": from_alone / m["ssgd_s"] - 1,
                     "error_from_concurrent": from_concurrent / m["ssgd_s"] - 1,
                     "measured_comm_s": m["ssgd_s"] - m["nocomm_s"], "gradient_bytes": m["gradient_bytes"]})
        ctx.log(f"swcaffe: {p} workers: measured {m['ssgd_s']:.3f} s; predicted {from_alone:.3f} s from one worker "
                f"alone ({100 * rows[-1]['error_from_alone']:+.0f}%), {from_concurrent:.3f} s from {p} at once "
                f"({100 * rows[-1]['error_from_concurrent']:+.0f}%)")
    return {"settings": payload, "cores": cores, "compute_alone_samples_s": alone, "load_average": load,
            "cost_model": {k: getattr(model, k) for k in ("alpha", "beta_inside", "gamma")}, "fit": fit,
            "rows": rows}
