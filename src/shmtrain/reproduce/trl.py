"""Reproductions of the IBM TRL paper (Le Duc et al.), Tables 3 and 4.

Both tables come from one measurement, as in the paper: AlexNet (torchvision, 10
classes, at a reduced input) trained by 2 workers with ``cpu_acc`` (TRL/Caffe,
Algorithms 5-7: gradients handed to the host's accumulator threads during backward,
``collectRemainingGradsFromCPU`` after it) and with ``ssgd`` (synchronous SGD that
collects after backward, the role of BVLC/Caffe2 in Table 3), in the interleaved rounds
of ``shmtrain bench overlap`` (:mod:`shmtrain.bench.overlap`, whose worker this module
wraps to time the one parameter broadcast of Algorithm 5 line 2 first).

* ``trl-table3`` (Table 3, CPU-ACC-TIMING): the phases of one iteration (broadcast,
  forward, backward, collect, accumulation, update) for both, and the claim that
  collecting what remains after backward costs a small fraction of collecting everything
  after it (the paper: 21.8 μs against 23 ms).
* ``trl-table4`` (Table 4, CPU-ACC-TIMING): ``cpu_acc``'s per-layer hand-off,
  accumulation and copy-back times, grouped into the paper's eight layers.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from shmtrain.reproduce.core import PAPERS, Claim, Context, Report, reproduction

#: Table 3 of the paper, ms per iteration, AlexNet, four P100 GPUs (None: "N/A")
PAPER_TABLE3 = {
    "BVLC/Caffe2": {"broadcast": 20.0, "forward": 50.6, "backward": 104.0, "collect_remaining": None,
                    "collect": 23.0, "update": 5.1, "total": 202.7},
    "TRL/Caffe": {"broadcast": None, "forward": 51.0, "backward": 111.0, "collect_remaining": 0.0218,
                  "collect": None, "update": 5.1, "total": 167.1},
}
#: Table 4 of the paper: per layer (8 = top, first in backward): millions of parameters,
#: GPU-to-CPU copy, accumulation on CPUs, CPU-to-GPU copy (ms)
PAPER_TABLE4 = {
    8: (4, 0.760, 1.263, 1.786), 7: (16.8, 3.156, 4.441, 2.568), 6: (37.8, 12.146, 13.074, 5.538),
    5: (0.4, 0.133, 0.285, 0.064), 4: (0.7, 0.174, 0.465, 0.095), 3: (0.9, 0.275, 0.578, 0.123),
    2: (0.3, 0.066, 0.155, 0.041), 1: (0.03, 0.014, 0.018, 0.007),
}
#: torchvision AlexNet's parameter prefixes for the paper's layers 1-8 (conv1-5, fc6-8)
LAYERS = {1: "features.0.", 2: "features.3.", 3: "features.6.", 4: "features.8.", 5: "features.10.",
          6: "classifier.1.", 7: "classifier.4.", 8: "classifier.6."}

MODES = ["ssgd", "cpu_acc"]
QUICK = {"input_shape": "3x224x224", "batch_size": 8, "rounds": 4, "warmup": 1}
FULL = {"input_shape": "3x224x224", "batch_size": 8, "rounds": 30, "warmup": 2}
WORKERS = 2
_CACHE: dict[tuple, dict[str, Any]] = {}


def _worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    """Time the one broadcast of the parameters (Algorithm 5 line 2; BVLC/Caffe2 pays it
    every iteration, Table 3's first column), then run bench overlap's rounds."""
    import torch

    from shmtrain.bench.overlap import overlap_worker
    from shmtrain.fabric.exchanges.weights import send_parameters
    from shmtrain.models import build_model
    from shmtrain.runtime.data.tensors import parse_shape
    from shmtrain.strategies.layout.flat import FlatLayout

    torch.manual_seed(ctx.rank)  # different weights, so the broadcast moves real data
    model = build_model(payload["model"], parse_shape(payload["input_shape"]), 10)
    layout = FlatLayout([p for p in model.parameters() if p.requires_grad])
    seconds = []
    for _ in range(2):
        ctx.host.barrier("trl broadcast")
        start = time.perf_counter()
        send_parameters(layout)  # dense every time (the digest check would skip the second)
        seconds.append(time.perf_counter() - start)
    del model, layout
    return dict(overlap_worker(ctx, payload), broadcast_s=min(seconds))


def measure(quick: bool, log=print) -> dict[str, Any]:
    """One launch of :data:`WORKERS` workers, ``ssgd`` and ``cpu_acc`` interleaved; phase
    medians (ms) per mode, the iteration (slowest worker per round, median) and
    ``cpu_acc``'s per-layer medians. Cached per setting: Tables 3 and 4 share a run."""
    from shmtrain.bench.step import MODES as SPECS
    from shmtrain.runtime.launch.launcher import launch

    setting = dict(QUICK if quick else FULL, model="alexnet", threads=1)
    key = tuple(sorted(setting.items()))
    if key in _CACHE:
        log("trl: reusing this process's measurement of the same setting")
        return _CACHE[key]
    log(f"trl: {WORKERS} workers, alexnet {setting['input_shape']}, batch {setting['batch_size']}, "
        f"{setting['rounds']} rounds of {' '.join(MODES)}")
    payload = dict(setting, modes=MODES, specs={m: SPECS[m] for m in MODES})
    results = launch("shmtrain.reproduce.trl:_worker", WORKERS, payload, threads=1, timeout=900)
    modes = summarize(results, MODES, setting["rounds"])
    data = {"setting": dict(setting, workers=WORKERS), "modes": modes,
            "broadcast_ms": 1e3 * statistics.median(r["broadcast_s"] for r in results)}
    _CACHE[key] = data
    return data


def summarize(results: list[dict[str, Any]], modes: list[str], rounds: int) -> dict[str, Any]:
    """Per mode, from the workers' returns of bench overlap's worker: the iteration (ms; the
    slowest worker per round, median over rounds), each phase's median over workers and
    rounds, the samples behind them (per worker, per round) and ``cpu_acc``'s per-layer
    medians (TRL Table 4)."""
    from shmtrain.bench.overlap import layer_medians

    summary: dict[str, Any] = {}
    for mode in modes:
        phases = [p for r in results for p in r["phases"][mode]]
        names = sorted({k for p in phases for k in p})
        summary[mode] = {
            "iteration_ms": 1e3 * statistics.median(max(r["samples"][mode][i] for r in results)
                                                    for i in range(rounds)),
            "iteration_samples_ms": [round(1e3 * max(r["samples"][mode][i] for r in results), 3)
                                     for i in range(rounds)],
            "phases_ms": {k: 1e3 * statistics.median(p.get(k, 0.0) for p in phases) for k in names},
            "phase_samples_ms": {k: [[round(1e3 * p.get(k, 0.0), 3) for p in r["phases"][mode]] for r in results]
                                 for k in names},
        }
        per_layer = [it for r in results for it in r["layers"].get(mode, [])]
        if per_layer:
            summary[mode]["layers"] = layer_medians(per_layer)
    return summary


def _ms(value: float | None) -> str:
    if value is None:
        return "N/A"
    return f"{value * 1e3:.1f} μs" if value < 1 else f"{value:.1f} ms"


def _collect(mode: str, phases: dict[str, Any]) -> Any:
    """The time after backward until the gradients are in place: ``ssgd``'s allreduce
    (``comm``), ``cpu_acc``'s ``collect_remaining``."""
    return phases["collect_remaining"] if mode == "cpu_acc" else phases["comm"]


def critical_collect(mode: dict[str, Any], name: str) -> float:
    """The collect on the critical path (ms): per round the smallest of the workers' collects
    (the worker that ends backward last waits for no one, so its collect is communication,
    not the other worker's lateness), median over rounds."""
    per_worker = _collect(name, mode["phase_samples_ms"])
    return statistics.median(min(values) for values in zip(*per_worker, strict=True))


_WHY = ("2 CPU cores shared by 2 workers (one compute thread each) and other jobs, against four "
        "P100 GPUs with a POWER8 host: our 'device' is a CPU core, so the host accumulation that the "
        "paper runs on idle CPUs here takes cycles from the other worker's backward; AlexNet with 10 "
        "classes (fc8 41k parameters instead of 4M); mini-batch 8 per worker instead of 256; shared "
        "memory instead of PCIe/NVLink copies.")


@reproduction(
    "trl-table3",
    f"{PAPERS['trl']}, Table 3",
    "Collecting and accumulating gradients on CPUs during backward leaves 21.8 μs of "
    "communication after backward (collectRemainingGradsFromCPU) for AlexNet on four GPUs, "
    "where BVLC/Caffe2 spends 23 ms collecting and accumulating after backward and 20 ms "
    "broadcasting.",
    ("CPU-ACC", "CPU-ACC-TIMING"),
)
def table3(ctx: Context) -> Report:
    """Table 3: phase times of ``cpu_acc`` against synchronous SGD collecting after backward."""
    data = measure(ctx.quick, ctx.log)
    ssgd, acc = data["modes"]["ssgd"], data["modes"]["cpu_acc"]
    collect_ssgd, remaining = critical_collect(ssgd, "ssgd"), critical_collect(acc, "cpu_acc")
    share = remaining / collect_ssgd
    plain_ssgd, plain_remaining = _collect("ssgd", ssgd["phases_ms"]), _collect("cpu_acc", acc["phases_ms"])
    paper_share = PAPER_TABLE3["TRL/Caffe"]["collect_remaining"] / PAPER_TABLE3["BVLC/Caffe2"]["collect"]
    total_ratio = acc["iteration_ms"] / ssgd["iteration_ms"]
    paper_total = PAPER_TABLE3["TRL/Caffe"]["total"] / PAPER_TABLE3["BVLC/Caffe2"]["total"]
    backward_ratio = acc["phases_ms"]["backward"] / ssgd["phases_ms"]["backward"]
    claims = [
        Claim("collect after backward: cpu_acc's collect-remaining vs synchronous SGD's collect",
              "21.8 μs vs 23 ms (0.09%)", f"{_ms(remaining)} vs {_ms(collect_ssgd)}",
              f"{share:.1%} (paper {paper_share:.2%})", share < 0.25,
              "on the critical path (per round the smaller of the workers' values), cpu_acc's median "
              "collect-remaining < 25% of ssgd's median collect (a bound that holds on a loaded machine)"),
        Claim("the same, against the verdict's threshold", "0.09%", f"{share:.1%}", "< 10%", share < 0.10),
        Claim("the same, every worker (waits for the slower worker included)", "-",
              f"{_ms(plain_remaining)} vs {_ms(plain_ssgd)}", f"{plain_remaining / plain_ssgd:.1%}",
              plain_remaining < 0.10 * plain_ssgd),
        Claim("accumulation on the host, in the background (grad-acc)", "N/A (23 ms in BVLC/Caffe2's collect)",
              f"{_ms(acc['phases_ms']['accumulate'])} per worker, during backward",
              f"{acc['phases_ms']['accumulate'] / acc['phases_ms']['backward']:.0%} of cpu_acc's backward",
              True),
        Claim("backward: longer with cpu_acc (hand-offs in the hooks)", "111 vs 104 ms (1.07x)",
              f"{_ms(acc['phases_ms']['backward'])} vs {_ms(ssgd['phases_ms']['backward'])}",
              f"{backward_ratio:.2f}x", backward_ratio > 1),
        Claim("broadcast: once at the start (cpu_acc) instead of every iteration (BVLC/Caffe2)",
              "20 ms per iteration vs N/A", f"{_ms(data['broadcast_ms'])} once (gloo, both strategies)",
              "paid once, not per iteration", True),
        Claim("iteration total, cpu_acc / synchronous SGD", "167.1 vs 202.7 ms (0.82x)",
              f"{_ms(acc['iteration_ms'])} vs {_ms(ssgd['iteration_ms'])}",
              f"{total_ratio:.2f}x (paper {paper_total:.2f}x)", total_ratio < 1),
    ]
    # the paper's collect-remaining is 0.09% of the collect: within 10% counts as the ratio
    # reproduced on this machine, where thread wake-ups alone take tens of microseconds
    verdict = "reproduced in ratio" if share < 0.10 else "not reproduced"
    notes = [
        f"Setting: {data['setting']}; each phase is the median over workers and rounds, the "
        "iteration the median over rounds of the slowest worker.",
        "Our 'collect' of synchronous SGD is ssgd's allreduce after backward (comm); BVLC/Caffe2's "
        "per-iteration broadcast has no counterpart in ssgd (every worker applies the same mean "
        "gradient), so both strategies broadcast once, as TRL/Caffe does.",
        "The update phase is the optimizer (SGD with momentum) on every worker in both strategies.",
        "Iteration totals (and backward) are information only: on 2 cores the accumulator threads "
        "compete with backward for the same cores, where the paper's CPUs were idle.",
    ]
    for name, label, row in (("ssgd", "synchronous SGD (ssgd)", ssgd), ("cpu_acc", "cpu_acc", acc)):
        phases = row["phases_ms"]
        notes.append(
            f"Ours, {label}, ms: broadcast {data['broadcast_ms']:.1f} (once), forward {phases['forward']:.1f}, "
            f"backward {phases['backward']:.1f}, {'collect-remaining' if name == 'cpu_acc' else 'collect'} "
            f"{critical_collect(row, name):.2f} (critical path; every worker {_collect(name, phases):.2f}), "
            f"accumulation {phases.get('accumulate', 0.0):.1f}"
            f"{' (background)' if name == 'cpu_acc' else ' (in collect)'}, "
            f"update {phases['update']:.1f}, iteration {row['iteration_ms']:.1f}.")
    return Report(claims, verdict, _WHY, data, lambda path: _plot_table3(data, path), notes)


def _plot_table3(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = ["forward", "backward", "collect", "update"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    rows = {
        "paper": {"BVLC/Caffe2": [50.6, 104.0, 23.0, 5.1], "TRL/Caffe": [51.0, 111.0, 0.0218, 5.1]},
        "ours": {m: [data["modes"][m]["phases_ms"]["forward"], data["modes"][m]["phases_ms"]["backward"],
                     critical_collect(data["modes"][m], m), data["modes"][m]["phases_ms"]["update"]]
                 for m in MODES},
    }
    colors = ["#4c72b0", "#55a868", "#c44e52", "#8172b2"]
    for ax, (title, table) in zip(axes, rows.items(), strict=True):
        for i, values in enumerate(table.values()):
            left = 0.0
            for phase, value, color in zip(phases, values, colors, strict=True):
                ax.barh(i, value, left=left, color=color, label=phase if i == 0 else None)
                left += value
        ax.set_yticks(range(len(table)), list(table))
        ax.set_xlabel("ms per iteration")
        ax.set_title(f"{title}: phases of one iteration (AlexNet)", fontsize=10)
    axes[0].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def per_paper_layer(layers: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Group ``cpu_acc``'s per-parameter medians (weight and bias) into the paper's layers 1-8."""
    grouped: dict[int, dict[str, float]] = {}
    for number, prefix in LAYERS.items():
        rows = [row for row in layers if row["layer"].startswith(prefix)]
        grouped[number] = {key: sum(row[key] for row in rows)
                           for key in ("numel", "copy_ms", "lock_wait_ms", "accumulate_ms", "copy_back_ms")}
    return grouped


@reproduction(
    "trl-table4",
    f"{PAPERS['trl']}, Table 4",
    "Per layer of AlexNet, the GPU-to-CPU copy, the accumulation on CPUs and the copy back "
    "overlap backward; their times follow the layer's size (fc6, 37.8M parameters: 13.074 ms "
    "accumulation; conv1, 0.03M: 0.018 ms), and the accumulation is much shorter than backward.",
    ("CPU-ACC", "CPU-ACC-TIMING"),
)
def table4(ctx: Context) -> Report:
    """Table 4: ``cpu_acc``'s per-layer copy / accumulate / copy-back times beside the paper's."""
    data = measure(ctx.quick, ctx.log)
    acc = data["modes"]["cpu_acc"]
    layers = per_paper_layer(acc["layers"])
    largest = max(layers, key=lambda n: layers[n]["numel"])
    smallest = min(layers, key=lambda n: layers[n]["numel"])
    big, small = layers[largest]["accumulate_ms"], layers[smallest]["accumulate_ms"]
    total_acc = sum(v["accumulate_ms"] for v in layers.values())
    backward = acc["phases_ms"]["backward"]
    ours_rate = big / (layers[largest]["numel"] / 1e6)
    paper_rate = PAPER_TABLE4[6][2] / PAPER_TABLE4[6][0]
    paper_acc = sum(v[2] for v in PAPER_TABLE4.values())
    order = sorted(layers, key=lambda n: layers[n]["numel"])
    ranks = {n: i for i, n in enumerate(sorted(layers, key=lambda n: layers[n]["accumulate_ms"]))}
    spearman = 1 - 6 * sum((i - ranks[n]) ** 2 for i, n in enumerate(order)) / (8 * (64 - 1))
    claims = [
        Claim(f"accumulation time follows the layer's size: largest (layer {largest}) vs smallest "
              f"(layer {smallest})", "layer 6 (37.8M) 13.074 ms vs layer 1 (0.03M) 0.018 ms",
              f"layer {largest} ({layers[largest]['numel'] / 1e6:.1f}M) {big:.3f} ms vs layer {smallest} "
              f"({layers[smallest]['numel'] / 1e6:.3f}M) {small:.3f} ms", f"{big / max(small, 1e-9):.0f}x",
              big > small, "the largest layer's median accumulation > the smallest layer's"),
        Claim("accumulation much shorter than backward (all layers)",
              f"{paper_acc:.1f} ms vs 111 ms backward ({paper_acc / 111:.2f})",
              f"{total_acc:.1f} ms vs {backward:.1f} ms", f"{total_acc / backward:.2f}",
              total_acc < backward, "sum of the per-layer median accumulations < cpu_acc's median backward"),
        Claim("rank correlation of accumulation time with layer size (8 layers)", "1.00 (Table 4)",
              f"{spearman:.2f}", "Spearman rho", spearman > 0.5),
        Claim("accumulation rate on the largest layer", f"{paper_rate:.2f} ms per million parameters (CPU sum)",
              f"{ours_rate:.2f} ms per million (one core, 2 workers)", f"{ours_rate / paper_rate:.1f}x the paper's",
              True),
    ]
    verdict = "reproduced in ratio" if big > small and total_acc < backward else "not reproduced"
    notes = [
        f"Setting: {data['setting']}; median over iterations and workers of each parameter's time, "
        "weight and bias summed into the paper's layers (1-5 conv, 6-8 fc). The run is trl-table3's "
        "(one measurement for both tables, as in the paper, when both run in one process).",
        "Hand-off ('GPU-to-CPU copy') is a queue entry here (the gradient is already in host memory) and "
        "copy-back a re-binding of the gradient to the shared sum; on a GPU both are copies "
        "(shmtrain.strategies.layout.staging), so only the accumulation column compares with the paper's.",
        "Our layer 8 (fc8) has 10 classes: 41k parameters instead of 4M. 'Lock wait' is the time the "
        "accumulator waited for the other worker's accumulation of the same layer (Algorithm 7's "
        "critical section).",
    ]
    for n in range(8, 0, -1):
        ours, paper = layers[n], PAPER_TABLE4[n]
        notes.append(
            f"Layer {n} ({ours['numel'] / 1e6:.3g}M; paper {paper[0]:g}M), ms ours (paper): hand-off "
            f"{ours['copy_ms']:.3f} ({paper[1]}), lock wait {ours['lock_wait_ms']:.3f}, accumulation "
            f"{ours['accumulate_ms']:.3f} ({paper[2]}), copy-back {ours['copy_back_ms']:.3f} ({paper[3]}).")
    data4 = {"setting": data["setting"], "layers": {str(n): v for n, v in layers.items()},
             "per_parameter": acc["layers"], "backward_ms": backward,
             "paper": {str(n): dict(zip(("million_parameters", "copy_ms", "accumulate_ms", "copy_back_ms"),
                                        v, strict=True)) for n, v in PAPER_TABLE4.items()}}
    return Report(claims, verdict, _WHY, data4, lambda path: _plot_table4(layers, path), notes)


def _plot_table4(layers: dict[int, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = list(range(8, 0, -1))  # backward order, as in Table 4
    fig, ax = plt.subplots(figsize=(8, 3.8))
    xs = range(len(order))
    ax.bar([x - 0.2 for x in xs], [PAPER_TABLE4[n][2] for n in order], 0.4, label="paper (P100 + POWER8)")
    ax.bar([x + 0.2 for x in xs], [max(layers[n]["accumulate_ms"], 1e-4) for n in order], 0.4,
           label="ours (2 CPU workers)")
    ax.set_xticks(list(xs), [f"L{n}\n{layers[n]['numel'] / 1e6:.2g}M ({PAPER_TABLE4[n][0]:g}M)"
                             for n in order], fontsize=8)
    ax.set_xlabel("layer, parameters ours (paper's)")
    ax.set_yscale("log")
    ax.set_ylabel("accumulation per iteration (ms)")
    ax.set_title("AlexNet per-layer accumulation on the host (backward order)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
