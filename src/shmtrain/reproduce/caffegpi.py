"""Reproductions of the CaffeGPI paper (Kuehn, Keuper and Pfreundt), Figs. 5 and 6.

``caffegpi-scaling``: AlexNet with a fixed overall mini-batch (strong scaling, as in
Figs. 5-6: "an overall batch size of 256") on 1 and 2 workers, with ``gpi`` (the
turn-based, layer-wise one-sided reduction and broadcast of Figs. 3-4, GPI-OVERLAP and
GPI-ONESIDED), ``ssgd`` (allreduce after backward, then every worker updates: the
standard data-parallel SGD of Fig. 2) and PyTorch DDP over gloo (the MPI-based
framework's role, Intel Caffe in Fig. 6), each beside ``nocomm`` (every worker trains
alone) in the interleaved rounds of ``shmtrain bench overlap``. Speed-up is samples per
second against one worker training alone. With 4 workers (time-shared on 2 cores, so
not timed) ``gpi``'s binomial trees two levels deep are checked for correctness: every
worker holds the same weights as single-process SGD on the union of the batches.
"""

from __future__ import annotations

import hashlib
import statistics
from pathlib import Path
from typing import Any

from shmtrain.reproduce.core import PAPERS, Claim, Context, Report, reproduction
from shmtrain.reproduce.trl import summarize

MODES = ["nocomm", "ddp", "ssgd", "gpi"]
#: AlexNet at a reduced input: the fully connected layers (54M of its 57M parameters) keep
#: their size, so communication weighs as in the paper while the convolutions shrink
QUICK = {"input_shape": "3x128x128", "overall_batch": 32, "rounds": 4, "warmup": 1, "check_steps": 6}
FULL = {"input_shape": "3x128x128", "overall_batch": 32, "rounds": 15, "warmup": 2, "check_steps": 20}
CHECK_WORKERS = 4


def _timings(setting: dict[str, Any], workers: int, modes: list[str], log) -> dict[str, Any]:
    """One launch of ``workers`` workers running ``modes`` in interleaved rounds."""
    from shmtrain.bench.step import MODES as SPECS
    from shmtrain.runtime.launch.launcher import launch

    batch = setting["overall_batch"] // workers
    log(f"caffegpi: {workers} worker(s), alexnet {setting['input_shape']}, batch {batch} each, "
        f"{setting['rounds']} rounds of {' '.join(modes)}")
    payload = {"model": "alexnet", "input_shape": setting["input_shape"], "batch_size": batch,
               "rounds": setting["rounds"], "warmup": setting["warmup"], "threads": 1,
               "modes": modes, "specs": {m: SPECS[m] for m in modes if m != "ddp"}}
    results = launch("shmtrain.bench.overlap:overlap_worker", workers, payload, threads=1, timeout=900)
    summary = summarize(results, modes, setting["rounds"])
    for row in summary.values():
        row["samples_per_s"] = setting["overall_batch"] / (row["iteration_ms"] / 1e3)
    return {"workers": workers, "batch_per_worker": batch, "modes": summary}


def after_backward_ms(row: dict[str, Any]) -> float:
    """Time after backward until the next forward may start, on the critical path (ms):
    per round the smallest over workers (the last to end backward waits for no one) of
    communication left (``comm``: ssgd's allreduce, gpi's finalization) plus the update
    (gpi's root updated every layer during backward), median over rounds."""
    samples = row["phase_samples_ms"]
    zero = [[0.0] * len(w) for w in samples["forward"]]
    per_worker = [[c + u for c, u in zip(cw, uw, strict=True)]
                  for cw, uw in zip(samples.get("comm", zero), samples.get("update", zero), strict=True)]
    return statistics.median(min(values) for values in zip(*per_worker, strict=True))


def paired(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Median over rounds of ``a``'s iteration over ``b``'s in the same round (seconds
    apart, so load that drifts over the run cancels)."""
    return statistics.median(x / y for x, y in zip(a["iteration_samples_ms"], b["iteration_samples_ms"],
                                                   strict=True))


def _check_model():
    """A convolution and two linear layers of different sizes (no batch norm, no dropout,
    so synchronous data parallelism equals single-process SGD)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 6 * 6, 64), nn.ReLU(), nn.Linear(64, 10))


def check_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    """Train ``gpi`` for a few steps; rank 0 also runs single-process SGD on the union of
    the workers' batches and returns the largest relative error; every rank returns a
    digest of its weights (all ranks must hold the same bits: the broadcast tree of Fig. 4)."""
    import torch
    from torch import nn

    from shmtrain.parallel.data_parallel import DataParallel

    model, reference = _check_model(), _check_model()

    def optimizer(m):
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    dp = DataParallel(model, optimizer(model), "gpi", ctx=ctx)
    ref_opt = optimizer(reference)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(1)
    world, batch, worst = ctx.world_size, payload["batch"], 0.0
    for _ in range(payload["steps"]):
        x = torch.randn((world * batch, 3, 8, 8), generator=gen)
        y = torch.randint(0, 10, (world * batch,), generator=gen)
        mine = slice(ctx.rank * batch, (ctx.rank + 1) * batch)
        dp.zero_grad()
        loss_fn(dp(x[mine]), y[mine]).backward()
        dp.step()
        if ctx.rank == 0:
            ref_opt.zero_grad()
            loss_fn(reference(x), y).backward()
            ref_opt.step()
            for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                worst = max(worst, float((p.detach() - q.detach()).norm() / q.detach().norm()))
    dp.close()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"digest": hashlib.sha1(flat.numpy().tobytes()).hexdigest(), "error": worst}


def _check(steps: int, log) -> dict[str, Any]:
    from shmtrain.runtime.launch.launcher import launch

    log(f"caffegpi: correctness, gpi with {CHECK_WORKERS} workers, {steps} steps")
    results = launch("shmtrain.reproduce.caffegpi:check_worker", CHECK_WORKERS,
                     {"steps": steps, "batch": 4}, threads=1, timeout=300)
    return {"workers": CHECK_WORKERS, "steps": steps, "relative_error": results[0]["error"],
            "identical_weights": len({r["digest"] for r in results}) == 1}


def _speedup(runs: dict[str, Any], mode: str, workers: int) -> float | None:
    base = runs["1"]["modes"]["nocomm"]["samples_per_s"]
    row = runs.get(str(workers), {}).get("modes", {}).get(mode)
    return row["samples_per_s"] / base if row else None


@reproduction(
    "caffegpi-scaling",
    f"{PAPERS['caffegpi']}, Figs. 5 and 6",
    "Layer-wise one-sided reduction and broadcast overlapped with backward (Figs. 3-4) makes "
    "AlexNet (overall batch 256) scale better than Caffe's standard data parallelism on one "
    "node with 4 GPUs (Fig. 5) and than MPI-based Intel Caffe across nodes (Fig. 6): "
    "\"A speedup of 2.4 on 4 nodes compared to one node\".",
    ("GPI-OVERLAP", "GPI-ONESIDED"),
)
def scaling(ctx: Context) -> Report:
    """Figs. 5-6: speed-up vs workers of gpi, ssgd and DDP; gpi's communication after backward."""
    setting = dict(QUICK if ctx.quick else FULL)
    runs = {"1": _timings(setting, 1, ["nocomm"] if ctx.quick else MODES, ctx.log)}
    runs["2"] = _timings(setting, 2, MODES, ctx.log)
    check = _check(setting["check_steps"], ctx.log)
    two = runs["2"]["modes"]
    gpi_after, ssgd_after = after_backward_ms(two["gpi"]), after_backward_ms(two["ssgd"])
    vs_ddp, vs_ssgd = paired(two["gpi"], two["ddp"]), paired(two["gpi"], two["ssgd"])
    vs_nocomm = paired(two["gpi"], two["nocomm"])
    correct = check["identical_weights"] and check["relative_error"] < 1e-4
    speedups = {m: _speedup(runs, m, 2) for m in MODES}
    claims = [
        Claim("speed-up at 2 workers over one worker alone (samples/s, overall batch fixed)",
              "Figs. 5-6: CaffeGPI above Caffe and Intel Caffe; 2.4 on 4 nodes (Fig. 6)",
              ", ".join(f"{m} {s:.2f}x" for m, s in speedups.items()),
              f"gpi {speedups['gpi']:.2f} of 2 ideal, {speedups['gpi'] / speedups['nocomm']:.2f} of nocomm's",
              speedups["gpi"] > speedups["ddp"]),
        Claim("gpi's iteration vs DDP's (the MPI-based framework's role), 2 workers",
              "CaffeGPI scales better than Intel Caffe (Fig. 6)",
              f"{two['gpi']['iteration_ms']:.0f} vs {two['ddp']['iteration_ms']:.0f} ms",
              f"{vs_ddp:.2f}x (paired per round)", vs_ddp < 1,
              "median over rounds of gpi's iteration / DDP's < 1"),
        Claim("communication hidden behind backward: time after backward, gpi vs ssgd (2 workers)",
              "finalization only; reduction, update and broadcast overlap backward (Figs. 3-4)",
              f"gpi {gpi_after:.1f} ms (finalization) vs ssgd {ssgd_after:.1f} ms (allreduce + update)",
              f"{gpi_after / ssgd_after:.0%}", gpi_after < ssgd_after,
              "on the critical path, gpi's median time after backward < ssgd's"),
        Claim("gpi's iteration vs synchronous SGD (allreduce after backward), 2 workers",
              "CaffeGPI above Caffe's standard data parallelism (Fig. 5)",
              f"{two['gpi']['iteration_ms']:.0f} vs {two['ssgd']['iteration_ms']:.0f} ms",
              f"{vs_ssgd:.2f}x (paired per round)", vs_ssgd < 1),
        Claim("gpi's iteration vs no communication, 2 workers", "-",
              f"{two['gpi']['iteration_ms']:.0f} vs {two['nocomm']['iteration_ms']:.0f} ms",
              f"{vs_nocomm:.2f}x (paired per round)", vs_nocomm < 1.5),
        Claim(f"correctness with {CHECK_WORKERS} workers (reduction and broadcast trees two levels deep)",
              "synchronous SGD", f"identical weights on all ranks: {check['identical_weights']}, relative "
              f"error to single-process SGD {check['relative_error']:.1e} after {check['steps']} steps",
              "same weights as SGD on the union of the batches", correct,
              "every rank's weights identical and within 1e-4 of single-process SGD"),
    ]
    verdict = ("reproduced in ratio" if vs_ddp < 1 and gpi_after < ssgd_after and correct
               else "not reproduced")
    why = ("2 CPU cores shared by the workers and other jobs, against 1-4 K80 GPUs on one node (Fig. 5) "
           "or on 4 InfiniBand nodes (Fig. 6): here a 'GPU' is one CPU core, so at 2 workers both cores "
           "compute and the reduction, the root's update and the weight copies that the paper hides behind "
           "GPU compute (in the network card, on idle CPUs) take cycles from backward; 4 workers "
           "time-share the 2 cores, so they are checked, not timed. AlexNet with 10 classes at 3x128x128 "
           "(the convolutions shrink, the fully connected layers keep 54M parameters), overall batch "
           f"{setting['overall_batch']} instead of 256; one-sided writes are shared-memory copies.")
    notes = [
        f"Setting: {setting}; 1 thread per worker; each worker count is one launch with the modes "
        "interleaved round by round (bench overlap's worker); an iteration is the slowest worker's, "
        "the median over rounds; speed-up = samples/s over those of one worker training alone "
        "(nocomm, whole overall batch).",
        "DDP stands in for the MPI-based framework (Intel Caffe, Fig. 6) and ssgd for Caffe's standard "
        "data parallelism (Fig. 2; Fig. 5's baseline): both communicate everything after (DDP: while) "
        "backward, then every worker updates.",
        "Time after backward: ssgd's allreduce + update; gpi's finalization (its root updated each "
        "layer during backward, the children read the new weights down the tree).",
        f"nocomm's speed-up ({speedups['nocomm']:.2f}x) is this machine's ceiling for every strategy: the "
        "fully connected layers' gradients and updates are memory-bound and the 2 cores share one "
        "memory bus, so halving the batch per worker does not halve the iteration; the speed-ups come "
        "from launches minutes apart, so they also move with other jobs' load (the paired ratios do not).",
    ]
    data = {"setting": setting, "runs": runs, "check": check,
            "speedup_2_workers": speedups, "after_backward_ms": {"gpi": gpi_after, "ssgd": ssgd_after},
            "paired_2_workers": {"gpi/ddp": vs_ddp, "gpi/ssgd": vs_ssgd, "gpi/nocomm": vs_nocomm}}
    return Report(claims, verdict, why, data, lambda path: _plot(runs, path), notes)


def _plot(runs: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = runs["1"]["modes"]["nocomm"]["samples_per_s"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    counts = sorted(int(n) for n in runs)
    for mode in MODES:
        points = [(n, runs[str(n)]["modes"][mode]["samples_per_s"] / base) for n in counts
                  if mode in runs[str(n)]["modes"]]
        axes[0].plot(*zip(*points, strict=True), marker="o", label=mode)
    axes[0].plot(counts, counts, ls=":", color="grey", label="ideal")
    axes[0].set_xlabel("workers (overall batch fixed)")
    axes[0].set_ylabel("speed-up over 1 worker alone")
    axes[0].set_xticks(counts)
    axes[0].legend(fontsize=8)
    axes[0].set_title("AlexNet, strong scaling (cf. Figs. 5-6)")
    two = runs["2"]["modes"]
    phases = ["forward", "backward", "comm", "update"]
    for i, mode in enumerate(MODES):
        left = 0.0
        for phase, color in zip(phases, ["#4c72b0", "#55a868", "#c44e52", "#8172b2"], strict=True):
            value = two[mode]["phases_ms"].get(phase, 0.0)
            axes[1].barh(i, value, left=left, color=color, label=phase if i == 0 else None)
            left += value
    axes[1].set_yticks(range(len(MODES)), MODES)
    axes[1].set_xlabel("ms per iteration (median phases), 2 workers")
    axes[1].set_title("where the time goes (comm: after backward)")
    axes[1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
