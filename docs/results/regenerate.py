"""Rewrite the docs' tables of measured runs from their JSON in docs/results/, or re-run them first.

Run from the repository's root (the venv active, or with .venv/bin/python):

    python docs/results/regenerate.py                     # every table from its JSON; runs nothing
    python docs/results/regenerate.py --check             # exit 1 naming each table its JSON does not give
    python docs/results/regenerate.py --list              # the tables: doc, JSON, what a re-run costs, commands
    python docs/results/regenerate.py --run diloco-outer  # re-run its commands, write its JSON, rewrite it
    python docs/results/regenerate.py --run diloco-outer diloco-compress diloco-measured   # about 3 minutes here
    python docs/results/regenerate.py --run all           # every table: hours, root, the peers (see --list)

A table lies in its doc between ``<!-- regenerated: NAME ... -->`` and ``<!-- end: NAME -->``
(HTML comments: not shown); edit its JSON or re-run it, not the text between them. Two kinds:

- the diloco tables are ``shmtrain train`` runs that this script runs itself, each in a fresh
  interpreter into a temporary folder; its ``summary.json`` gives the figures (held-out
  accuracy; ``comm`` and ``iteration`` from ``phases_ms``), and the JSON keeps the date, the
  cores and the load average with them;
- every other table is written from the JSON its benchmark wrote with ``--json``
  (``bench allreduce``, ``bench hosts``, ``bench overlap``, ...): ``--run`` runs that command
  (``Table.commands``), ``--list`` says what it needs (root for the network namespaces of
  ``bench hosts``, MPICH and DeepSpeed for ``--peers``) and how long it takes.

The accuracies are deterministic (the same bits on every run of the same code); the
milliseconds are the machine's and the day's: the doc says when and where each table ran,
beside it. ``tests/project/test_docs.py`` runs ``--check`` and edits a figure of every table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"


def json_path(name: str) -> Path:
    """A table's JSON: a bare name lies in docs/results/, one with a folder from the repository's root."""
    return ROOT / name if "/" in name else RESULTS / name


@dataclasses.dataclass(frozen=True)
class Table:
    """One generated region of a doc: the JSON it is written from, how it is written as
    markdown (``render``), and how the JSON is made again: ``runs`` (key -> the words after
    ``shmtrain``, each run by this script) or ``commands`` (shell lines, run from the
    repository's root, that write the JSON themselves)."""

    name: str
    doc: str
    #: one file of docs/results/, or several (``render`` then gets {file name: its data})
    json: str | tuple[str, ...]
    runs: Callable[[], dict[str, list[str]]] | None
    render: Callable[[Any], str]
    commands: tuple[str, ...] = ()
    #: what ``--run`` of it takes (time, root, peers, a GPU), where more than a few minutes or this machine
    cost: str = ""

    @property
    def files(self) -> tuple[str, ...]:
        return (self.json,) if isinstance(self.json, str) else self.json

    def data(self) -> Any:
        loaded = {name: json.loads(json_path(name).read_text()) for name in self.files}
        return loaded[self.json] if isinstance(self.json, str) else loaded


# -- docs/diloco.md ----------------------------------------------------------------------------------
OUTER_BASE = ["train", "--workers", "4", "--batch-size", "16", "--iterations", "400", "--seed", "3"]
#: the H = 8 grid: (inner momentum, outer lr), each with outer momentum 0, 0.5 and 0.9
GRID_ROWS = [("0.9", "0.7"), ("0.9", "1.0"), ("0", "0.7"), ("0", "1.0")]
GRID_MUS = ["0", "0.5", "0.9"]
#: H = 32: the candidates of the grid (inner momentum, outer lr, outer momentum)
H32 = [("0.9", "1.0", "0.5"), ("0.9", "1.0", "0"), ("0.9", "0.7", "0.5"), ("0", "0.7", "0.9"), ("0", "1.0", "0.9")]
#: the derived defaults (diloco.outer_defaults): under SGD with momentum, and without
DEFAULTS = {"0.9": ("1.0", "0.5"), "0": ("0.7", "0.9")}


def _outer(h: int, momentum: str, lr: str, mu: str) -> list[str]:
    return [*OUTER_BASE, "--strategy", "diloco", "--sync-every", str(h), "--momentum", momentum,
            "--outer-lr", lr, "--outer-momentum", mu]


def outer_runs() -> dict[str, list[str]]:
    runs = {"ssgd": [*OUTER_BASE, "--strategy", "ssgd"]}
    for momentum, lr in GRID_ROWS:
        for mu in GRID_MUS:
            runs[f"h8 {momentum} {lr} {mu}"] = _outer(8, momentum, lr, mu)
    for momentum, lr, mu in H32:
        runs[f"h32 {momentum} {lr} {mu}"] = _outer(32, momentum, lr, mu)
    for h in (8, 32):  # no outer flag: the defaults
        runs[f"h{h} defaults"] = [*OUTER_BASE, "--strategy", "diloco", "--sync-every", str(h)]
    return runs


def _acc(run: dict, bold: bool = False) -> str:
    text = f"{run['accuracy']:.4f}"
    text = f"**{text}**" if bold else text
    return text + (" (diverged)" if run["accuracy"] < 0.5 else "")


def render_outer(data: dict) -> str:
    runs = data["runs"]
    lines = [f"ssgd: **{runs['ssgd']['accuracy']:.4f}**. diloco, H = 8 (bold: the default outer step "
             "for that inner optimizer):", "",
             "| inner SGD momentum | outer lr | outer μ 0 | outer μ 0.5 | outer μ 0.9 |", "|---|---|---|---|---|"]
    for momentum, lr in GRID_ROWS:
        label = "0.9 (the default)" if momentum == "0.9" else momentum
        cells = [_acc(runs[f"h8 {momentum} {lr} {mu}"], DEFAULTS[momentum] == (lr, mu)) for mu in GRID_MUS]
        lines.append(f"| {label} | {lr} | " + " | ".join(cells) + " |")

    def h32(momentum: str) -> str:
        return ", ".join(f"({lr}, {mu}) {_acc(runs[f'h32 {m} {lr} {mu}'], DEFAULTS[m] == (lr, mu))}"
                         for m, lr, mu in H32 if m == momentum)

    lines += ["", f"H = 32 (the candidates): inner momentum 0.9 with {h32('0.9')}; inner momentum 0 with "
              f"{h32('0')}. With no outer flag (the default outer step): H = 8 "
              f"{runs['h8 defaults']['accuracy']:.4f}, H = 32 {runs['h32 defaults']['accuracy']:.4f}.",
              "", _when(data)]
    return "\n".join(lines)


COMPRESS = ["", "topk:0.1,bits:4", "topk:0.01,bits:4", "topk:0.01,bits:4,feedback:off"]


def compress_runs() -> dict[str, list[str]]:
    base = [*OUTER_BASE, "--strategy", "diloco", "--sync-every", "8"]
    return {spec or "none": base + (["--compress", spec] if spec else []) for spec in COMPRESS}


def render_compress(data: dict) -> str:
    from shmtrain.fabric.compress.codec import Codec, parse_compress

    params = 151_306  # smallcnn on digits (tests/project/test_docs.py checks it)
    lines = ["| `--compress` | held-out accuracy | bytes per outer step (`smallcnn`) |", "|---|---|---|"]
    for spec in COMPRESS:
        nbytes = Codec(params, parse_compress(spec)).nbytes if spec else 4 * params
        name = f"`{spec}`" if spec else "none"
        lines.append(f"| {name} | {data['runs'][spec or 'none']['accuracy']:.4f} | {nbytes:,} |")
    return "\n".join([*lines, "", _when(data)])


MEASURED_BASE = ["train", "--workers", "4", "--iterations", "300", "--seed", "1"]
#: key -> (the options after --strategy diloco --sync-every 10, what the row is)
MEASURED = {
    "diloco-outer": (["--outer-lr", "0.7", "--outer-momentum", "0.9"], "DiLoCo's outer step"),
    "diloco-plain": (["--outer-lr", "1", "--outer-momentum", "0"], "plain averaging"),
    "diloco": ([], "the default outer step: 1.0, 0.5 under SGD with momentum"),
    "diloco-bf16": (["--outer-dtype", "bf16", "--fragments", "2"], ""),
    "host-sync": (["--inner", "host-sync"], "one host: ssgd + an outer step on one trajectory"),
    "host-sync-outer": (["--inner", "host-sync", "--outer-lr", "0.7", "--outer-momentum", "0.9"],
                        "the same with DiLoCo's outer step"),
}


def measured_runs() -> dict[str, list[str]]:
    runs = {"ssgd": [*MEASURED_BASE, "--strategy", "ssgd"]}
    for key, (options, _) in MEASURED.items():
        runs[key] = [*MEASURED_BASE, "--strategy", "diloco", "--sync-every", "10", *options]
    return runs


def render_measured(data: dict) -> str:
    runs = data["runs"]
    lines = ["| options | held-out accuracy | comm ms/iter | share of the iteration |", "|---|---|---|---|"]

    def row(label: str, run: dict) -> str:
        return (f"| {label} | {100 * run['accuracy']:.2f}% | {run['comm_ms']:.2f} | "
                f"{100 * run['comm_ms'] / run['iteration_ms']:.1f}% |")

    lines.append(row("ssgd", runs["ssgd"]))
    for key, (options, what) in MEASURED.items():
        flags = " ".join(["--sync-every 10", *options])
        lines.append(row(f"diloco `{flags}`" + (f" ({what})" if what else ""), runs[key]))
    return "\n".join([*lines, "", _when(data)])


def _when(data: dict) -> str:
    return (f"(One run each, {data['date']}, {data['machine']}; load average {data['load']:.1f} at the start; "
            f"`python docs/results/regenerate.py --run {data['table']}`: `docs/results/{data['table']}.json`.)")


# -- README.md: benchmarks that write their JSON themselves -------------------------------------------
def render_checkpoint(rows: list) -> str:
    lines = ["| model | params | MB per rank | iteration s | snapshot s | save s | load s | validate s | "
             "save / iteration |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['params_m']:.1f} M | {r['mb_per_rank']:.0f} | {r['iteration_s']:.3f} | "
              f"{r['snapshot_s']:.3f} | {r['save_s']:.3f} | {r['load_s']:.3f} | {r['validate_s']:.3f} | "
              f"{r['save_per_iteration']:.2f} |" for r in rows]
    return "\n".join(lines)


def render_lightning(rows: list) -> str:
    lines = ["| peer | ms per step (median) | min | max | vs DDP on gloo | rounds |", "|---|---|---|---|---|---|"]
    names = {"ddp-gloo": "`DDPStrategy` on gloo", "ddp-shm": "`DDPStrategy(process_group_backend=\"shm\")`",
             "shmtrain": "`ShmtrainStrategy(\"ssgd\")`"}
    lines += [f"| {names[r['peer']]} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | {r['max_ms']:.2f} | "
              f"{r['speedup']:.2f}x | {r['rounds']} |" for r in rows]
    return "\n".join(lines)


def render_allreduce(rows: list) -> str:
    lines = ["| procs | MiB | shm | gloo | gloo/shm | floor | shm/floor | read floor | gloo/read floor |",
             "|---|---|---|---|---|---|---|---|---|"]
    by = {(r["impl"], r["procs"], r["bytes"]): r for r in rows}
    for procs, size in sorted({(r["procs"], r["bytes"]) for r in rows}):
        shm, gloo = by[("shm", procs, size)], by[("gloo", procs, size)]
        ms = {k: 1e3 * v for k, v in (("shm", shm["median_s"]), ("gloo", gloo["median_s"]),
                                       ("floor", shm["floor_s"]), ("read", shm["read_floor_s"]))}
        lines.append(f"| {procs} | {size >> 20} | {ms['shm']:.2f} | {ms['gloo']:.2f} | {ms['gloo'] / ms['shm']:.1f} | "
                     f"{ms['floor']:.2f} | {ms['shm'] / ms['floor']:.2f} | {ms['read']:.2f} | "
                     f"{ms['gloo'] / ms['read']:.1f} |")
    return "\n".join(lines)


HOSTS_LABELS = {"ssgd": "ssgd (hierarchical allreduce)", "hsgd": "hsgd (one group per host)", "seasgd": "seasgd",
                "ddp": "DDP over gloo (flat)"}


def render_hosts(data: dict) -> str:
    lines = ["| method | s to 95% from launch | after start-up | ms per iteration (comm) |", "|---|---|---|---|"]
    lines += [f"| {HOSTS_LABELS.get(r['method'], r['method'])} | {r['time_to_target_s']:.1f} | "
              f"{r['train_time_to_target_s']:.1f} | {r['iteration_ms']:.0f} ({r['comm_ms']:.0f}) |"
              for r in data["rows"]]
    return "\n".join(lines)



# -- docs/collectives.md (and the README's excerpt): bench allreduce --peers -----------------------------
def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _ms3(seconds: float, above: str = ".1f") -> str:
    """Milliseconds with 3 decimals, or ``above``'s format from 10 ms up."""
    ms = 1e3 * seconds
    return f"{ms:{above if ms >= 10 else '.3f'}}"


def _sig3(seconds: float) -> str:
    """Milliseconds to 3 significant figures (3 decimals under 1 ms)."""
    ms = 1e3 * seconds
    return f"{ms:.3f}" if ms < 1 else f"{ms:.{max(0, 2 - len(str(int(ms))) + 1)}f}"


PEERS = {"gloo": "gloo", "mpich": "MPICH", "deepspeed": "DeepSpeed"}


def _peer_rows(rows: list) -> list[tuple[int, int, dict, str]]:
    """(procs, bytes, {impl: row}, the best peer's impl) per procs and size, in order."""
    by: dict[tuple[int, int], dict] = {}
    for r in rows:
        by.setdefault((r["procs"], r["bytes"]), {})[r["impl"]] = r
    out = []
    for (procs, size), impls in sorted(by.items()):
        best = min((p for p in PEERS if p in impls), key=lambda p: impls[p]["median_s"])
        out.append((procs, size, impls, best))
    return out


def render_peers(rows: list) -> str:
    lines = ["| procs | size | zero-copy | private | gloo | MPICH | DeepSpeed | best peer | private / best | "
             "zero-copy / read floor | zero-copy / result floor | zero-copy / fresh read |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for procs, size, r, best in _peer_rows(rows):
        shm, private = r["shm"], r["shm-private"]["median_s"]
        zc = shm["median_s"]
        lines.append(f"| {procs} | {_size(size)} | {_ms3(zc)} | {_ms3(private)} | "
                     + " | ".join(_ms3(r[p]["median_s"]) for p in PEERS)
                     + f" | {PEERS[best]} | {private / r[best]['median_s']:.2f} | {zc / shm['read_floor_s']:.2f} | "
                     f"{zc / shm['result_floor_s']:.2f} | {zc / shm['fresh_read_floor_s']:.2f} |")
    return "\n".join(lines)


def render_floors(rows: list) -> str:
    lines = ["| procs | size | zero-copy | read floor | fresh read | result floor | zero-copy / read floor | "
             "larger floor / read floor | zero-copy / larger floor |", "|---|---|---|---|---|---|---|---|---|"]
    for procs, size, r, _ in _peer_rows(rows):
        if size < 1 << 20:
            continue
        shm = r["shm"]
        zc, read, fresh, result = (shm[k] for k in ("median_s", "read_floor_s", "fresh_read_floor_s",
                                                     "result_floor_s"))
        larger = max(fresh, result)
        lines.append(f"| {procs} | {_size(size)} | " + " | ".join(_ms3(v, ".2f") for v in (zc, read, fresh, result))
                     + f" | {zc / read:.2f} | {larger / read:.2f} | {zc / larger:.2f} |")
    return "\n".join(lines)


#: the README's excerpt of the peers table: these sizes
README_PEERS = (4 << 10, 16 << 20, 256 << 20)


def render_readme_peers(rows: list) -> str:
    lines = ["| procs | size | shmtrain (private tensor) | gloo | MPICH | DeepSpeed shm | shmtrain / best peer |",
             "|---|---|---|---|---|---|---|"]
    for procs, size, r, best in _peer_rows(rows):
        if size in README_PEERS:
            private = r["shm-private"]["median_s"]
            lines.append(f"| {procs} | {_size(size)} | {_sig3(private)} | "
                         + " | ".join(_sig3(r[p]["median_s"]) for p in PEERS)
                         + f" | {private / r[best]['median_s']:.2f} |")
    return "\n".join(lines)


def render_plans(data: dict) -> str:
    """8 processes, each plan forced: CPU ms per call summed over the ranks, and wall ms."""
    runs = {plan: {r["bytes"]: r for r in data[f"bench_allreduce_8procs_{plan}.json"] if r["impl"] == "shm-private"}
            for plan in ("all-read", "split")}
    lines = ["| procs | size | all-read CPU | split CPU | all-read wall | split wall |", "|---|---|---|---|---|---|"]
    for size in sorted(runs["split"]):
        a, b = runs["all-read"][size], runs["split"][size]
        lines.append(f"| {a['procs']} | {_size(size)} | {1e3 * a['cpu_s']:.1f} | {1e3 * b['cpu_s']:.1f} | "
                     f"{1e3 * a['median_s']:.1f} | {1e3 * b['median_s']:.1f} |")
    return "\n".join(lines)



# -- docs/choosing_a_method.md, docs/hosts.md: bench hosts -------------------------------------------------
#: how a grid point's keys read in a table (a key not named here is left out: outer_dtype)
POINT_WORDS = {"lr": "lr {}", "sync_every": "H {}", "update_interval": "interval {}", "lr_schedule": "{}",
               "moving_rate": "alpha {}", "outer_lr": "outer lr {}", "outer_momentum": "outer momentum {}"}


def point_label(point: dict | None, leave_out: tuple[str, ...] = ()) -> str:
    return ", ".join(POINT_WORDS[k].format(f"{v:g}" if isinstance(v, float) else v)
                     for k, v in (point or {}).items() if k in POINT_WORDS and k not in leave_out)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _host_cells(r: dict, ddp: dict | None, leave_out: tuple[str, ...]) -> dict[str, str]:
    """Every cell a bench hosts table may show for the row ``r`` (the method's medians)."""
    tta, span = r["time_to_target_s"], r["time_to_target_range_s"]
    ddp_tta = ddp and ddp["time_to_target_s"]
    ddp_after = ddp and ddp["train_time_to_target_s"]
    after = r["train_time_to_target_s"]
    afters = [t["train_time_to_target_s"] for t in r.get("runs", [r]) if t["train_time_to_target_s"] is not None]
    ratio = ddp["link_mb"] / r["link_mb"] if ddp and r["link_mb"] else None
    return {
        "method": r["method"], "point": point_label(r.get("grid_point"), leave_out), "evaluated": r["evaluated"],
        "tta": _s(tta), "after": _s(after),
        "tta_range": "-" if tta is None else f"{tta:.1f} ({span[0]:.1f}-{span[1]:.1f})",
        "after_span": "-" if after is None else f"{after:.1f} ({min(afters):.1f}-{max(afters):.1f})",
        "vs_ddp": "-" if tta is None or not ddp_tta else f"{ddp_tta / tta:.1f}x",
        "vs_ddp_after": "-" if after is None or not ddp_after else f"{ddp_after / after:.1f}x",
        "iterations_to_target": "-" if r["iterations_to_target"] is None else str(r["iterations_to_target"]),
        "best": f"{r['best_accuracy']:.3f}", "final": f"{r['final_accuracy']:.3f}",
        "final4": f"{r['final_accuracy']:.4f}",
        "vs_ddp_final": "-" if ddp is None else ("0" if r is ddp else
                                                  f"{100 * (r['final_accuracy'] - ddp['final_accuracy']):+.1f} points"
                                                  .replace("+0.0", "0.0").replace("-", "-")),
        "iters": "/".join(str(i) for i in r["iterations_per_host"]), "iterations": str(r["iterations"]),
        "comm_pct": f"{100 * r['comm_share']:.0f}", "comm_ms": f"{r['comm_ms']:.1f}",
        "iteration_ms": f"{r['iteration_ms']:.0f}", "iteration_ms1": f"{r['iteration_ms']:.1f}",
        "link_mb": f"{r['link_mb']:,.0f}", "link_mb1": f"{r['link_mb']:,.1f}", "link_mb2": f"{r['link_mb']:,.2f}",
        "link_mb_auto": f"{r['link_mb']:.2f}" if r["link_mb"] < 10 else f"{r['link_mb']:.1f}" if r["link_mb"] < 1000
        else f"{r['link_mb']:,.0f}",
        "fewer_bytes": "-" if ratio is None else f"{ratio:,.0f}x",
        "vs_ddp_bytes": "-" if ratio is None else "1" if r is ddp else f"1/{ratio:.0f}",
        "startup": "/".join(f"{v:.1f}" for v in r["startup_per_host_s"]), "startup1": f"{r['startup_s']:.1f}",
        "startup_rounds": " / ".join(f"{run['startup_s']:.1f}" for run in r.get("runs", [r])),
    }


def hosts_table(columns: list[tuple[str, str]], order: tuple[str, ...] = (), bold: dict[str, str] | None = None,
                names: dict[str, str] | None = None, leave_out: tuple[str, ...] = ("outer_dtype",)
                ) -> Callable[[dict], str]:
    """A renderer of a bench hosts JSON's rows: ``columns`` (header, cell key of ``_host_cells``),
    the methods in ``order`` (else the JSON's), ``bold`` (method -> the keys shown in bold,
    space-separated), ``names`` (method -> how its name reads)."""

    def render(data: dict) -> str:
        rows = {r["method"]: r for r in data["rows"]}
        ddp = rows.get("ddp")
        lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
        for method in order or list(rows):
            cells = _host_cells(rows[method], ddp, leave_out)
            cells["method"] = (names or {}).get(method, method)
            strong = (bold or {}).get(method, "").split()
            lines.append("| " + " | ".join(f"**{cells[k]}**" if k in strong else cells[k] for _, k in columns) + " |")
        return "\n".join(lines)

    return render


def hosts_trials(order: tuple[str, ...] = (), leave_out: tuple[str, ...] = ("outer_dtype", "outer_momentum",
                                                                             "outer_lr")) -> Callable[[dict], str]:
    """The tuning trials of a bench hosts JSON: one row per method, its grid points side by side."""

    def render(data: dict) -> str:
        lines = ["| method | trial | s to 90% | best acc | final acc |", "|---|---|---|---|---|"]
        for method in order or list(data["tuning"]):
            trials = data["tuning"][method]
            lines.append(f"| {method} | " + " | ".join(" / ".join(cell(t) for t in trials) for cell in (
                lambda t: point_label(t["grid_point"], leave_out), lambda t: _s(t["time_to_target_s"]),
                lambda t: f"{t['best_accuracy']:.3f}", lambda t: f"{t['final_accuracy']:.3f}")) + " |")
        return "\n".join(lines)

    return render


def render_600it(data: dict) -> str:
    """The uncompressed methods run on to 600 iterations, against the tuned run's DDP."""
    ddp = next(r for r in data[f"{RN}.json"]["rows"] if r["method"] == "ddp")
    lines = [f"| method (grid point 2) | s to 90% | vs DDP's {ddp['time_to_target_s']:.1f} s | iterations to 90% "
             "(`iterations_to_target`) | ms/iter | final acc |", "|---|---|---|---|---|---|"]
    rows = sorted(data[f"{RN}-600it.json"]["rows"], key=lambda r: r["time_to_target_s"])
    for r in rows:
        c = _host_cells(r, ddp, ("outer_dtype", "outer_momentum"))
        speed = ddp["time_to_target_s"] / r["time_to_target_s"]
        lines.append(f"| {r['method']}, {c['point']} | {c['tta']} | {speed:.{1 if speed >= 1 else 2}f}x | "
                     f"{c['iterations_to_target']} | {c['iteration_ms']} | {c['final']} |")
    return "\n".join(lines)


def render_startup(data: dict) -> str:
    """Round 1's start-up marks (seconds from the launch until every worker passed each one)."""
    runs = {r["method"]: r["runs"][0]["startup_phases_s"] for r in data["rows"]}  # ddp has no `joined`: gloo
    methods = ["diloco", "hybrid", "ssgd", "ddp"]
    marks = [("`process` (the worker exists: forked by the agent, or a new interpreter)", "process"),
             ("`imports` (the worker's own: none left after the fork)", "imports"),
             ("`store`, `host`, `gloo`, `joined` (rendezvous, shared memory, gloo groups)", "joined"),
             ("`data`, `model`", "model"),
             ("`strategy` (DataParallel: the initial weights cross the 100 Mbit/s link)", "strategy"),
             ("first iteration", "first-iteration")]
    lines = ["| phase (until every worker passed it) | diloco, `shmtrain torchrun` | hybrid | ssgd | "
             "ddp, plain torchrun |", "|---|---|---|---|---|"]
    lines += [f"| {label} | " + " | ".join(f"{runs[m].get(key, runs[m]['gloo']):.2f}" for m in methods) + " |"
              for label, key in marks]
    return "\n".join(lines)



# -- docs/overlap.md, docs/gpu.md, docs/collectives.md, the README: bench overlap ----------------------------
MODE_NAMES = {"ddp": "ddp (gloo)", "ssgd_overlap": "ssgd --overlap", "ssgd_sharded": "ssgd --sharded-update"}
LONG = "bench_overlap_resnet18_long.json"
SHORT = tuple(f"bench_overlap_resnet18_{i}.json" for i in (1, 2, 3))


def _modes(rows: list) -> dict[str, dict]:
    return {r["mode"]: r for r in rows}


def render_overlap_long(data: dict) -> str:
    """The 90-round run beside the three 30-round runs (paired ratios to nocomm)."""
    long, short = _modes(data[LONG]), [_modes(data[f]) for f in SHORT]
    names = {**MODE_NAMES, "ssgd": "ssgd (not overlapped)"}
    bold = {"ddp": "iteration", "gpi": "iteration", "cpu_acc": "iteration share", "ssgd_overlap": "iteration"}
    lines = ["| mode | iteration vs nocomm, 90 rounds | the three 30-round runs | CPU vs nocomm, 90 rounds | "
             "collect_remaining share, 90 rounds |", "|---|---|---|---|---|"]
    for mode, r in long.items():
        share = r["collect_remaining_share"]
        cells = {"iteration": f"{r['paired_vs_nocomm']:.3f}",
                 "share": "- (inside backward)" if mode == "ddp" else "-" if share is None else f"{100 * share:.2f}%"}
        cells = {k: f"**{v}**" if k in bold.get(mode, "").split() else v for k, v in cells.items()}
        name = f"nocomm ({r['median_s']:.3f} s)" if mode == "nocomm" else names.get(mode, mode)
        runs = "1.000" if mode == "nocomm" else " ".join(f"{s[mode]['paired_vs_nocomm']:.3f}" for s in short)
        lines.append(f"| {name} | {cells['iteration']} | {runs} | {r['paired_cpu_vs_nocomm']:.3f} | {cells['share']} |")
    return "\n".join(lines)


def render_readme_overlap(rows: list) -> str:
    modes = _modes(rows)
    lines = ["| mode | median s | vs nocomm (paired) | time left after backward |", "|---|---|---|---|"]
    for mode in ("nocomm", "ddp", "ssgd", "ssgd_overlap", "cpu_acc", "gpi"):
        r = modes[mode]
        share = r["collect_remaining_share"]
        lines.append(f"| {MODE_NAMES.get(mode, mode)} | {r['median_s']:.3f} | {r['paired_vs_nocomm']:.3f} |"
                     + ("" if share is None else f" {100 * share:.2f}%") + " |")
    return "\n".join(lines)


#: the 90-round run's cpu_acc layers the table shows (backward order)
LAYERS = ("fc.weight", "layer4.1.conv2.weight", "layer4.0.conv1.weight", "layer3.1.conv2.weight",
          "layer1.0.conv1.weight", "conv1.weight")


def render_layers(rows: list) -> str:
    layers = {layer["layer"]: layer for layer in _modes(rows)["cpu_acc"]["layers"]}
    lines = ["| layer (backward order) | numel | hand-off | lock wait | accumulate | back |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {name} | {layers[name]['numel']} | " + " | ".join(
        f"{layers[name][k]:.3f}" for k in ("copy_ms", "lock_wait_ms", "accumulate_ms", "copy_back_ms")) + " |"
        for name in LAYERS]
    return "\n".join(lines)


def render_staged_cpu(rows: list) -> str:
    modes = _modes(rows)
    lines = ["| mode | zero copy, paired vs nocomm | staged (copy mode), paired vs nocomm | copies to host, ms | "
             "copies back, ms |", "|---|---|---|---|---|"]
    for mode in ("ssgd", "gpi", "cpu_acc", "ssgd_overlap"):
        copy = modes[f"{mode}@copy"]
        lines.append(f"| {MODE_NAMES.get(mode, mode)} | {modes[mode]['paired_vs_nocomm']:.3f} | "
                     f"{copy['paired_vs_nocomm']:.3f} | {copy['copy_to_host_ms']:.2f} | "
                     f"{copy['copy_to_device_ms']:.2f} |")
    return "\n".join(lines)


DDP_MODES = {"ddp-noop": "ddp-noop (DDP, a hook that communicates nothing)", "ddp": "ddp (gloo)",
             "ddp-shm": "ddp-shm (`shmtrain.ddp_comm_hook`)", "ddp-backend": "ddp-backend (`cpu:shm`)"}


def render_ddp_backend(rows: list) -> str:
    lines = ["| mode | median s | paired vs nocomm | CPU paired |", "|---|---|---|---|"]
    for r in rows:
        paired = f"{r['paired_vs_nocomm']:.3f}"
        lines.append(f"| {DDP_MODES.get(r['mode'], r['mode'])} | {r['median_s']:.3f} | "
                     f"{f'**{paired}**' if r['mode'] == 'ddp-noop' else paired} | {r['paired_cpu_vs_nocomm']:.3f} |")
    return "\n".join(lines)



def render_ddp_hook(rows: list) -> str:
    """DDP with shmtrain.ddp_comm_hook against DDP over gloo and no communication."""
    names = {"ddp": "ddp (gloo)", "ddp-shm": "ddp-shm (the hook)"}
    lines = ["| mode | median s | min s | vs nocomm (medians) | paired vs nocomm | CPU s / iteration | CPU paired |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {names.get(r['mode'], r['mode'])} | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['vs_nocomm']:.3f} | "
              f"{r['paired_vs_nocomm']:.3f} | {r['cpu_s']:.3f} | {r['paired_cpu_vs_nocomm']:.3f} |" for r in rows]
    return "\n".join(lines)


def render_sharded(rows: list) -> str:
    """ssgd --sharded-update against ssgd and no communication (ms: the phases' means)."""
    lines = ["| mode | median s | paired vs nocomm | CPU paired | update (ms, mean) | update_wait (ms) | comm (ms) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        phases = r["phases_s"]
        wait = phases.get("update_wait")
        paired = f"{r['paired_vs_nocomm']:.3f}"
        paired = f"**{paired}**" if r["mode"] == "ssgd_sharded" else paired
        lines.append(f"| {MODE_NAMES.get(r['mode'], r['mode'])} | {r['median_s']:.3f} | {paired} | "
                     f"{r['paired_cpu_vs_nocomm']:.3f} | "
                     f"{1e3 * phases['update']:.1f}{' (wait included)' if wait is not None else ''} | "
                     f"{'-' if wait is None else f'{1e3 * wait:.1f}'} | {1e3 * phases['comm']:.1f} |")
    return "\n".join(lines)


# -- docs/collectives.md: bench collectives ------------------------------------------------------------
ALGORITHMS = ("shm", "gloo", "ring", "rhd", "tree", "topo", "hierarchical")


def render_collectives(rows: list) -> str:
    """Median ms (the fastest sample in parentheses) per algorithm."""
    by = {(r["procs"], r["bytes"], r["impl"]): r for r in rows}
    lines = ["| procs | MiB | " + " | ".join(ALGORITHMS) + " |", "|---|---|" + "---|" * len(ALGORITHMS)]
    for procs, size in sorted({(r["procs"], r["bytes"]) for r in rows}):
        cells = [f"{1e3 * by[(procs, size, a)]['median_s']:.2f} ({1e3 * by[(procs, size, a)]['min_s']:.2f})"
                 for a in ALGORITHMS]
        lines.append(f"| {procs} | {size / (1 << 20):g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- docs/async.md: bench seasgd, bench smb ----------------------------------------------------------------
def render_seasgd(rows: list) -> str:
    """ShmCaffe eq. (8) per worker (ms per iteration)."""
    lines = ["| rank | T_comp ms | T_wwi | T_ugw | T_rgw | T_ulw | wait | T_iter | eq. (8) | exposed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['rank']} | " + " | ".join(f"{1e3 * r[k]:.1f}" for k in (
        "T_comp", "T_wwi", "T_ugw", "T_rgw", "T_ulw", "T_wait", "T_iter", "T_iter_eq8"))
        + f" | {100 * r['exposed_fraction']:.1f}% |" for r in rows]
    return "\n".join(lines)


def render_smb(rows: list) -> str:
    """Aggregate GB/s of the buffer service per process count."""
    by = {(r["procs"], r["op"]): r for r in rows}
    ops = ("read", "write", "readwrite", "accumulate", "copy")
    lines = ["| procs | read | write | read/write 50/50 | accumulate | copy |", "|---|---|---|---|---|---|"]
    lines += [f"| {procs} | " + " | ".join(f"{by[(procs, op)]['aggregate_GBps']:.2f}" for op in ops) + " |"
              for procs in sorted({p for p, _ in by})]
    return "\n".join(lines)


# -- docs/parameter_servers.md: bench ps -------------------------------------------------------------------
def render_ps(rows: list) -> str:
    lines = ["| strategy | transport | workers | gather | average | broadcast | bcast_wait | comm (server) | "
             "iteration |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['strategy']} | {r['transport']} | {r['workers']} | " + " | ".join(f"{r[k]:.2f}" for k in (
        "gather_ms", "average_ms", "broadcast_ms", "bcast_wait_ms", "comm_ms", "iteration_ms")) + " |" for r in rows]
    return "\n".join(lines)


def render_hpsearch(data: dict) -> str:
    """HP-SEARCH's winners (SHM-Learn-Dist Table 5.1): per worker count, the kept run of least area."""
    lines = ["| workers | batch | lr | min loss | area (loss x s) | held-out accuracy |", "|---|---|---|---|---|---|"]
    lines += [f"| {workers} | {b['batch']} | {b['lr']:g} | {b['min_loss']:.3f} | {b['area_time']:.3f} | "
              f"{100 * b['accuracy']:.1f}% |" for workers, b in sorted(data["best"].items(), key=lambda kv: int(kv[0]))]
    return "\n".join(lines)


# -- docs/subbatch.md: bench subbatch -------------------------------------------------------------------
def render_subbatch(rows: list) -> str:
    lines = ["| K | mode | ms/iter (median) | min ms | samples/s | vs 1 thread | thr/proc | paired |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['threads_vs_processes']:.3f} | {r['paired_threads_vs_processes']:.3f}" if (
            "threads_vs_processes" in r) else "|"
        lines.append(f"| {r['parts']} | {r['mode']} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | "
                     f"{r['samples_per_s']:.1f} | {r['speedup']:.2f} | {ratio} |".replace("|  |", "| |"))
    return "\n".join(lines)



def render_hosts_tta(data: dict) -> str:
    """docs/hosts.md: the first version of bench hosts (wide_mlp, 1 Gbit/s, target 95%)."""
    names = {"ssgd": "ssgd (hierarchical)", "hsgd": "hsgd (2 groups of 2)", "ddp": "ddp (flat gloo)"}
    lines = ["| method | s to 95% (from launch) | per round | s to 95% after start | final acc | iterations (rank 0) | "
             "comm ms/iter | ms/iter | start-up s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        tta = f"{r['time_to_target_s']:.1f}"
        rounds = ", ".join(f"{run['time_to_target_s']:.1f}" for run in r["runs"])
        tta = f"**{tta}**" if r["method"] in ("ssgd", "hsgd") else tta
        lines.append(f"| {names.get(r['method'], r['method'])} | {tta} | {rounds} | "
                     f"{r['train_time_to_target_s']:.1f} | {r['final_accuracy']:.4f} | {r['iterations']} | "
                     f"{r['comm_ms']:.1f} | {r['iteration_ms']:.1f} | {r['startup_s']:.1f} |")
    return "\n".join(lines)


def render_hosts_bf16(data: dict) -> str:
    lines = ["| method | s to 95% (from launch) | after start | final acc | comm ms/iter | ms/iter |",
             "|---|---|---|---|---|---|"]
    for r in data["rows"]:
        tta = f"{r['time_to_target_s']:.1f}"
        lines.append(f"| {'ddp (flat gloo)' if r['method'] == 'ddp' else r['method']} | "
                     f"{f'**{tta}**' if r['method'] == 'ssgd-bf16' else tta} | {r['train_time_to_target_s']:.1f} | "
                     f"{r['final_accuracy']:.4f} | {r['comm_ms']:.1f} | {r['iteration_ms']:.1f} |")
    return "\n".join(lines)


# -- docs/async.md: bench smb --remote --------------------------------------------------------------------
SMB = {"bench_smb_remote_256mib.json": "`shmtrain bench smb --remote --procs 1 2 --size 256MiB --reps 3 --samples 3`",
       "bench_smb_remote_64mib.json": "`... --size 64MiB --reps 3 --samples 3`",
       "bench_smb_remote.json": "`... --size 4MiB --reps 5 --samples 3`"}


def render_smb_remote(data: dict) -> str:
    lines = ["| size | clients | read / gloo | write / gloo | readwrite / gloo | command (JSON) |",
             "|---|---|---|---|---|---|"]
    for name, command in SMB.items():
        ops = {(r["procs"], r["op"]): r for r in data[name]}
        for procs in sorted({p for p, _ in ops}):
            ratios = " | ".join(f"{ops[(procs, op)]['vs_gloo']:.2f}" for op in ("read", "write", "readwrite"))
            size = _size(ops[(procs, "read")]["bytes"])
            where = f"{command} (`docs/results/{name}`)" if procs == 1 else "same run"
            lines.append(f"| {size} | {procs} | {ratios} | {where} |")
    return "\n".join(lines)


# -- docs/data.md: examples/data_bench.py ---------------------------------------------------------------
def render_data_loading(data: dict) -> str:
    lines = ["| files (train + val) | peak RSS per training worker (rank 0 / 1) | data ms / iteration ms | "
             "data share |", "|---|---|---|---|"]
    lines += [f"| {r['files']:,} | {' / '.join(f'{v:.0f}' for v in r['worker_rss_mib'])} MiB | "
              f"{r['data_ms']:.1f} / {r['iteration_ms']:.0f} | {100 * r['data_share']:.1f}% |" for r in data["rows"]]
    return "\n".join(lines)


# -- docs/diloco.md: bytes on the link, bench compress ----------------------------------------------------
LINK_METHODS = {"floor": "floor", "ssgd": "ssgd", "ssgd-bf16": "ssgd `--comm-dtype bf16`",
                "diloco-H20": "diloco `--sync-every 20`",
                "diloco-H20-bf16": "diloco `--sync-every 20 --outer-dtype bf16`",
                "diloco-H20-F4-overlap2": "diloco `--sync-every 20 --fragments 4 --overlap-steps 2 --mixing 0.5`",
                "hybrid-H20-bf16": "hybrid `--inner host-sync --sync-every 20 --outer-dtype bf16`"}


def render_link_bytes(data: dict) -> str:
    rows = {r["method"]: r for r in data["rows"]}
    ssgd = rows["ssgd"]["bytes_per_iteration"]
    lines = ["| method | MB on the link | kB per iteration over the floor | of ssgd's |", "|---|---|---|---|"]
    for method, label in LINK_METHODS.items():
        r = rows[method]
        per = r["bytes_per_iteration"]
        share = "" if not per else "1" if method == "ssgd" else f"1/{ssgd / per:.2f}"
        lines.append(f"| {label} | {r['link_bytes'] / 1e6:.2f} | {per / 1e3:,.{0 if not per else 1}f} | {share} |"
                     .replace("|  |", "| |"))
    return "\n".join(lines)


def render_compress_bench(rows: list) -> str:
    lines = ["| `--compress` | payload bytes | ratio | compress GB/s, C | compress GB/s, torch | C / torch | "
             "same bits | decompress GB/s |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| `{r['compress']}` | {r['payload_bytes']:,} | {r['ratio']:.1f} | **{r['compress_gb_s']:.2f}** | "
              f"{r['torch_compress_gb_s']:.2f} | {r['speedup']:.1f}x | {'yes' if r['same_as_torch'] else 'no'} | "
              f"{r['decompress_gb_s']:.2f} |" for r in rows]
    return "\n".join(lines)


# -- docs/collectives.md: PyTorch's distributed tests on the shm backend ---------------------------------
def render_conformance(data: dict) -> str:
    lines = ["| ranks started | world size | tests selected | gloo pass | shm pass | gloo pass, shm not | "
             "explained apart | shm reductions (tests) | minutes gloo / shm |", "|---|---|---|---|---|---|---|---|---|"]
    for name in ("conformance_upstream_fork.json", "conformance_upstream_spawn_subset.json"):
        for r in data[name]["runs"]:
            start = r["start"] if r["selected"] == 182 else f"{r['start']}, {r['selected']} tests*"
            lines.append(f"| {start} | {r['world_size']} | {r['selected']} | {r['passed_gloo']} | {r['passed_shm']} | "
                         f"**{len(r['gloo_pass_shm_fail'])}** | {len(r['gloo_pass_shm_fail_explained'])} | "
                         f"{r['shm_reductions']} ({r['tests_with_shm_reductions']}) | "
                         f"{r['seconds']['gloo'] / 60:.1f} / {r['seconds']['shm'] / 60:.1f} |")
    return "\n".join(lines)


#: the 18 tests spawned at 3 and 4 ranks (docs/collectives.md)
CONFORMANCE_SUBSET = (
    "test_all_reduce_sum", "test_all_reduce_sum_async", "test_all_reduce_sum_complex", "test_all_reduce_full_group_sum",
    "test_all_reduce_coalesced_sum", "test_all_reduce_coalesced_full_group_sum", "test_DistributedDataParallelCPU",
    "test_DistributedDataParallelCPU_grad_is_view", "test_ddp_create_graph",
    "test_accumulate_gradients_no_sync_allreduce_hook", "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_monitored_barrier_gloo", "test_ddp_logging_data_cpu", "test_destroy_group", "test_destroy_full_group",
    "test_barrier", "test_broadcast", "test_all_gather")
ROOT_HOSTS = "root: two network namespaces"
CHOOSING, MLP, RN = "docs/choosing_a_method.md", "choosing-mlp-100mbit", "choosing-resnet18-1gbit"


def _hosts(setting: str, options: str, suffix: str, plot: bool = False) -> tuple[str, ...]:
    """The ``bench hosts --setting`` command of a docs/choosing_a_method.md table."""
    files = f"--json docs/results/{setting}{suffix}.json"
    files += f" --plot docs/figures/{setting}{suffix}.png" if plot else ""
    return (f"shmtrain bench hosts --setting {setting.removeprefix('choosing-')} {options} {files}",)


TABLES = {t.name: t for t in [
    Table("diloco-outer", "docs/diloco.md", "diloco-outer.json", outer_runs, render_outer),
    Table("diloco-compress", "docs/diloco.md", "diloco-compress.json", compress_runs, render_compress),
    Table("diloco-measured", "docs/diloco.md", "diloco-measured.json", measured_runs, render_measured),
    Table("bench-allreduce", "README.md", "bench_allreduce.json", None, render_allreduce,
          ("shmtrain bench allreduce --json docs/results/bench_allreduce.json",)),
    Table("bench-lightning", "docs/integrations.md", "bench_lightning.json", None, render_lightning,
          ("shmtrain bench lightning --rounds 5 --json docs/results/bench_lightning.json",)),
    Table("bench-checkpoint", "README.md", "bench_checkpoint.json", None, render_checkpoint,
          ("shmtrain bench checkpoint --model smallcnn resnet18 resnet50 --reps 5 --json "
           "docs/results/bench_checkpoint.json",)),
    Table("bench-hosts", "README.md", "bench_hosts_tta.json", None, render_hosts,
          ("shmtrain bench hosts --repeat 3 --json docs/results/bench_hosts_tta.json --plot "
           "docs/figures/bench_hosts_tta.png",), "root: network namespaces; about 30 minutes"),
    Table("bench-allreduce-peers", "docs/collectives.md", "bench_allreduce_peers.json", None, render_peers,
          ("shmtrain bench allreduce --procs 2 4 --reps 30 --json docs/results/bench_allreduce_peers.json",),
          "MPICH and DeepSpeed: pip install '.[peers]'; about 10 minutes"),
    Table("bench-allreduce-floors", "docs/collectives.md", "bench_allreduce_peers.json", None, render_floors,
          ("shmtrain bench allreduce --procs 2 4 --reps 30 --json docs/results/bench_allreduce_peers.json",),
          "the same run as bench-allreduce-peers"),
    Table("readme-allreduce-peers", "README.md", "bench_allreduce_peers.json", None, render_readme_peers,
          ("shmtrain bench allreduce --procs 2 4 --reps 30 --json docs/results/bench_allreduce_peers.json",),
          "the same run as bench-allreduce-peers"),
    Table("bench-allreduce-plans", "docs/collectives.md",
          ("bench_allreduce_8procs_all-read.json", "bench_allreduce_8procs_split.json"), None, render_plans,
          tuple(f"SHMTRAIN_ALLREDUCE_ALGORITHM={plan} shmtrain bench allreduce --procs 8 --sizes 4MiB 64MiB "
                f"--reps 5 --peers --json docs/results/bench_allreduce_8procs_{plan}.json"
                for plan in ("all-read", "split"))),
    # docs/choosing_a_method.md: bench hosts --setting (root: two network namespaces)
    Table("choosing-mlp-100mbit", CHOOSING, f"{MLP}.json", None, hosts_table(
        [("method", "method"), ("chosen grid point", "point"), ("evaluated", "evaluated"),
         ("s to 90% (range)", "tta_range"), ("after start", "after"), ("vs DDP", "vs_ddp"), ("best acc", "best"),
         ("final acc", "final"), ("iters a/b", "iters"), ("comm %", "comm_pct"), ("link MB", "link_mb"),
         ("startup a/b s", "startup")], ("ddp", "ssgd", "hsgd", "seasgd", "diloco", "hybrid", "one-host"),
        {"hybrid": "method tta_range after vs_ddp final"}, leave_out=("outer_dtype", "outer_momentum")),
          _hosts(MLP, "--repeat 3", "", plot=True), ROOT_HOSTS + "; about 50 minutes"),
    Table("choosing-mlp-100mbit-trials", CHOOSING, f"{MLP}.json", None,
          hosts_trials(("ddp", "ssgd", "diloco", "hybrid", "hsgd", "seasgd", "one-host")),
          _hosts(MLP, "--repeat 3", "", plot=True), "the same run as choosing-mlp-100mbit"),
    Table("choosing-startup", CHOOSING, f"{MLP}.json", None, render_startup,
          _hosts(MLP, "--repeat 3", "", plot=True), "the same run as choosing-mlp-100mbit"),
    Table("choosing-seasgd-topk", CHOOSING, f"{MLP}-seasgd-topk.json", None, hosts_table(
        [("method", "method"), ("s to 90%", "tta"), ("after start", "after"), ("best acc", "best"),
         ("final acc", "final"), ("vs DDP's final", "vs_ddp_final"), ("iters a/b", "iters"),
         ("comm ms/it", "comm_ms"), ("link MB", "link_mb1")],
        bold={"seasgd-topk": "method final vs_ddp_final"}, names={"seasgd": "seasgd (whole weights)"}),
          _hosts(MLP, "--no-tune --grid-point 3 --methods seasgd-topk hsgd-topk seasgd ddp", "-seasgd-topk"),
          ROOT_HOSTS + "; about 10 minutes"),
    Table("choosing-hsgd-topk", CHOOSING, f"{MLP}-hsgd-topk.json", None, hosts_table(
        [("method", "method"), ("grid point 3", "point"), ("s to 90%", "tta"), ("after start", "after"),
         ("best acc", "best"), ("final acc", "final"), ("vs DDP's final", "vs_ddp_final"), ("iters a/b", "iters"),
         ("comm ms/it", "comm_ms"), ("link MB", "link_mb1")], bold={"hsgd-topk": "method final vs_ddp_final"}),
          _hosts(MLP, "--no-tune --grid-point 3 --methods hsgd-topk seasgd-topk ddp", "-hsgd-topk"),
          ROOT_HOSTS + "; about 8 minutes"),
    Table("choosing-elastic-topk", CHOOSING, f"{MLP}-elastic-topk.json", None, hosts_table(
        [("method", "method"), ("grid point 3", "point"), ("s to 90%", "tta"), ("after start", "after"),
         ("best acc", "best"), ("final acc", "final"), ("vs DDP's final", "vs_ddp_final"), ("iters a/b", "iters"),
         ("link MB", "link_mb1")],
        bold={"seasgd-topk": "method final vs_ddp_final", "hsgd-topk": "method final vs_ddp_final"}),
          _hosts(MLP, "--no-tune --grid-point 3 --methods seasgd-topk hsgd-topk ddp", "-elastic-topk"),
          ROOT_HOSTS + "; about 7 minutes"),
    Table("choosing-defaults", CHOOSING, f"{MLP}-defaults.json", None, hosts_table(
        [("method", "method"), ("s to 90%", "tta"), ("after start", "after"), ("best acc", "best"),
         ("final acc", "final"), ("vs DDP's final", "vs_ddp_final"), ("iters a/b", "iters"),
         ("link MB", "link_mb1")]),
          _hosts(MLP, "--no-tune --methods ssgd hsgd seasgd diloco hybrid diloco-topk hybrid-topk seasgd-topk "
                 "hsgd-topk ddp", "-defaults", plot=True),
          ROOT_HOSTS + "; about 15 minutes"),
    Table("choosing-topk", CHOOSING, f"{MLP}-topk.json", None, hosts_table(
        [("method", "method"), ("s to 90%", "tta"), ("after start", "after"), ("vs DDP", "vs_ddp"),
         ("best acc", "best"), ("final acc", "final"), ("iters a/b", "iters"), ("comm ms/it", "comm_ms"),
         ("link MB", "link_mb1"), ("vs DDP's bytes", "vs_ddp_bytes")],
        bold={"hybrid-topk": "method tta vs_ddp final link_mb1 vs_ddp_bytes"},
        names={"diloco": "diloco (bf16)", "hybrid": "hybrid (bf16)"}),
          _hosts(MLP, "--no-tune --grid-point 2 --methods diloco-topk hybrid-topk diloco hybrid ddp", "-topk"),
          ROOT_HOSTS + "; about 12 minutes"),
    Table("choosing-topk-tuned", CHOOSING, f"{MLP}-topk-tuned.json", None, hosts_table(
        [("method", "method"), ("chosen grid point", "point"), ("s to 90% (range)", "tta_range"),
         ("after start", "after"), ("vs DDP from the launch", "vs_ddp"), ("vs DDP after start", "vs_ddp_after"),
         ("iterations to 90%", "iterations_to_target"), ("best acc", "best"), ("final acc", "final"),
         ("link MB", "link_mb_auto"), ("fewer bytes than DDP", "fewer_bytes"), ("startup s", "startup1")],
        bold={"hybrid-topk": "method after vs_ddp vs_ddp_after final link_mb_auto fewer_bytes"},
        leave_out=("outer_dtype", "outer_lr")),
          _hosts(MLP, "--repeat 3 --methods ddp hybrid-topk diloco-topk", "-topk-tuned", plot=True),
          ROOT_HOSTS + "; about 35 minutes"),
    Table("choosing-topk-tuned-trials", CHOOSING, f"{MLP}-topk-tuned.json", None,
          hosts_trials(("ddp", "hybrid-topk", "diloco-topk"), ("outer_dtype", "outer_lr")),
          _hosts(MLP, "--repeat 3 --methods ddp hybrid-topk diloco-topk", "-topk-tuned", plot=True),
          "the same run as choosing-topk-tuned"),
    Table("choosing-topk-idle", CHOOSING, f"{MLP}-topk-idle.json", None, hosts_table(
        [("method", "method"), ("s to 90% (range)", "tta_range"), ("after start", "after_span"),
         ("startup s", "startup1"), ("ms/iter", "iteration_ms"), ("link MB", "link_mb2")]),
          _hosts(MLP, "--no-tune --grid-point 2 --repeat 3 --methods hybrid-topk diloco-topk", "-topk-idle"),
          ROOT_HOSTS + "; about 3 minutes"),
    Table("choosing-resnet18-topk", CHOOSING, f"{RN}-topk.json", None, hosts_table(
        [("method", "method"), ("chosen grid point", "point"), ("s to 90% (range)", "tta_range"),
         ("after start", "after"), ("iterations to 90%", "iterations_to_target"), ("best acc", "best"),
         ("final acc", "final"), ("ms/iter", "iteration_ms"), ("comm %", "comm_pct"), ("link MB", "link_mb_auto"),
         ("startup s (rounds)", "startup_rounds")], bold={"hybrid-topk": "method tta_range after link_mb_auto"}),
          _hosts(RN, "--methods hybrid-topk ddp --repeat 3", "-topk", plot=True), ROOT_HOSTS + "; about 25 minutes"),
    Table("choosing-resnet18-topk-trials", CHOOSING, f"{RN}-topk.json", None,
          hosts_trials(("hybrid-topk", "ddp"), ("outer_dtype", "outer_lr", "outer_momentum")),
          _hosts(RN, "--methods hybrid-topk ddp --repeat 3", "-topk", plot=True),
          "the same run as choosing-resnet18-topk"),
    Table("choosing-resnet18-1gbit", CHOOSING, f"{RN}.json", None, hosts_table(
        [("method", "method"), ("chosen grid point", "point"), ("evaluated", "evaluated"),
         ("s to 90% (range)", "tta_range"), ("after start", "after"), ("best acc", "best"), ("final acc", "final"),
         ("iters a/b", "iters"), ("ms/iter", "iteration_ms"), ("comm %", "comm_pct"), ("link MB", "link_mb"),
         ("startup a/b s", "startup")], ("ddp", "hsgd", "seasgd", "diloco", "hybrid", "one-host"),
        {"ddp": "tta_range comm_pct"}, leave_out=("outer_dtype", "outer_momentum")),
          _hosts(RN, "--methods hsgd seasgd diloco hybrid ddp one-host --repeat 3", "", plot=True),
          ROOT_HOSTS + "; about 60 minutes"),
    Table("choosing-resnet18-1gbit-trials", CHOOSING, f"{RN}.json", None,
          hosts_trials(("ddp", "diloco", "hybrid", "hsgd", "seasgd", "one-host")),
          _hosts(RN, "--methods hsgd seasgd diloco hybrid ddp one-host --repeat 3", "", plot=True),
          "the same run as choosing-resnet18-1gbit"),
    Table("choosing-resnet18-600it", CHOOSING, (f"{RN}-600it.json", f"{RN}.json"), None, render_600it,
          _hosts(RN, "--grid-point 2 --methods hybrid diloco hsgd --iterations 600", "-600it"),
          ROOT_HOSTS + "; about 5 minutes (DDP's figure: choosing-resnet18-1gbit)"),
    # bench overlap: ResNet-18 3x64x64, batch 32 per worker, 2 workers of 1 thread
    Table("overlap-resnet18", "docs/overlap.md", (LONG, *SHORT), None, render_overlap_long,
          ("shmtrain bench overlap --workers 2 --rounds 90 --modes nocomm ddp ssgd gpi cpu_acc ssgd_overlap "
           f"--json docs/results/{LONG}",
           *(f"shmtrain bench overlap --workers 2 --rounds 30 --modes nocomm ddp ssgd gpi cpu_acc ssgd_overlap "
             f"--json docs/results/{name}" for name in SHORT)), "about 15 minutes"),
    Table("overlap-cpu-acc-layers", "docs/overlap.md", LONG, None, render_layers,
          ("shmtrain bench overlap --workers 2 --rounds 90 --modes nocomm ddp ssgd gpi cpu_acc ssgd_overlap "
           f"--json docs/results/{LONG}",), "the 90-round run of overlap-resnet18"),
    Table("readme-overlap", "README.md", LONG, None, render_readme_overlap,
          ("shmtrain bench overlap --workers 2 --rounds 90 --modes nocomm ddp ssgd gpi cpu_acc ssgd_overlap "
           f"--json docs/results/{LONG}",), "about 6 minutes"),
    Table("overlap-staged-cpu", "docs/gpu.md", "bench_overlap_staged_cpu.json", None, render_staged_cpu,
          ("shmtrain bench overlap --workers 2 --rounds 12 --modes nocomm ssgd ssgd@copy gpi gpi@copy cpu_acc "
           "cpu_acc@copy ssgd_overlap ssgd_overlap@copy --json docs/results/bench_overlap_staged_cpu.json",)),
    Table("ddp-backend-2026-11-24", "docs/collectives.md", "bench_overlap_ddp_backend.json", None, render_ddp_backend,
          ("shmtrain bench overlap --modes nocomm ddp-noop ddp ddp-shm ddp-backend --model resnet18 --workers 2 "
           "--rounds 15 --json docs/results/bench_overlap_ddp_backend.json",)),
    Table("hosts-tta", "docs/hosts.md", "bench_hosts_tta.json", None, render_hosts_tta,
          ("shmtrain bench hosts --repeat 3 --json docs/results/bench_hosts_tta.json --plot "
           "docs/figures/bench_hosts_tta.png",), ROOT_HOSTS + "; about 30 minutes"),
    Table("hosts-bf16", "docs/hosts.md", "bench_hosts_bf16.json", None, render_hosts_bf16,
          ("shmtrain bench hosts --methods ssgd ssgd-bf16 ddp --repeat 2 --json docs/results/bench_hosts_bf16.json",),
          ROOT_HOSTS + "; about 5 minutes"),
    Table("smb-remote", "docs/async.md", tuple(SMB), None, render_smb_remote,
          ("shmtrain bench smb --remote --procs 1 2 --size 256MiB --reps 3 --samples 3 --json "
           "docs/results/bench_smb_remote_256mib.json",
           "shmtrain bench smb --remote --procs 1 2 --size 64MiB --reps 3 --samples 3 --json "
           "docs/results/bench_smb_remote_64mib.json",
           "shmtrain bench smb --remote --procs 1 2 --size 4MiB --reps 5 --samples 3 --json "
           "docs/results/bench_smb_remote.json")),
    Table("data-loading", "docs/data.md", "data_loading.json", None, render_data_loading,
          ("python examples/data_bench.py --sizes 2000 20000 --iterations 200 --out docs/results/data_loading.json",),
          "needs psutil; about 10 minutes"),
    Table("diloco-link-bytes", "docs/diloco.md", "diloco_link_bytes.json", None, render_link_bytes,
          ("python examples/diloco_link_bytes.py --iterations 60 --json docs/results/diloco_link_bytes.json",),
          ROOT_HOSTS + "; about 5 minutes"),
    Table("compress-bench", "docs/diloco.md", "compress-bench.json", None, render_compress_bench,
          ("shmtrain bench compress --threads 1 --repeats 20 --json docs/results/compress-bench.json",)),
    Table("conformance", "docs/collectives.md",
          ("conformance_upstream_fork.json", "conformance_upstream_spawn_subset.json"), None, render_conformance,
          ("PYTHONPATH=src:tests python tests/support/conformance/compare.py --world-sizes 2 3 4 --start fork --json "
           "docs/results/conformance_upstream_fork.json --record tests/support/conformance/gloo_passes.json",
           "PYTHONPATH=src:tests python tests/support/conformance/compare.py --world-sizes 3 4 --start spawn --tests "
           + " ".join(CONFORMANCE_SUBSET) + " --json docs/results/conformance_upstream_spawn_subset.json"),
          "needs expecttest; about 35 minutes"),
    Table("ddp-hook", "docs/collectives.md", "bench_overlap_ddp_hook.json", None, render_ddp_hook,
          ("shmtrain bench overlap --modes nocomm ddp ddp-shm --model resnet18 --workers 2 --rounds 20 --json "
           "docs/results/bench_overlap_ddp_hook.json",)),
    Table("sharded-update", "docs/overlap.md", "bench_overlap_sharded.json", None, render_sharded,
          ("shmtrain bench overlap --workers 2 --rounds 20 --modes nocomm ssgd ssgd_sharded --json "
           "docs/results/bench_overlap_sharded.json",)),
    Table("bench-collectives", "docs/collectives.md", "bench_collectives.json", None, render_collectives,
          ("shmtrain bench collectives --procs 2 4 --sizes 64KiB 1MiB 16MiB --reps 20 --json "
           "docs/results/bench_collectives.json",)),
    Table("seasgd-eq8", "docs/async.md", "bench_seasgd_resnet18.json", None, render_seasgd,
          ("shmtrain bench seasgd --workers 2 --model resnet18 --iterations 30 --json "
           "docs/results/bench_seasgd_resnet18.json",)),
    Table("smb-bandwidth", "docs/async.md", "bench_smb.json", None, render_smb,
          ("shmtrain bench smb --procs 1 2 4 8 --size 64MiB --json docs/results/bench_smb.json",)),
    Table("bench-ps", "docs/parameter_servers.md", "docs/figures/ps/bench_ps.json", None, render_ps,
          ("shmtrain bench ps --json docs/figures/ps/bench_ps.json",)),
    Table("hpsearch", "docs/parameter_servers.md", "docs/figures/ps/hpsearch.json", None, render_hpsearch,
          ("shmtrain experiment hpsearch --out docs/figures/ps",)),
    Table("bench-subbatch", "docs/subbatch.md", "bench_subbatch_smallcnn.json", None, render_subbatch,
          ("shmtrain bench subbatch --rounds 60 --json docs/results/bench_subbatch_smallcnn.json",)),

]}


# -- running, rewriting, checking ---------------------------------------------------------------------
def run_table(table: Table, log: Callable[[str], None] = print, done: set[str] | None = None) -> dict:
    """Run every command of ``table`` (one after another, each in a fresh interpreter) and
    write its JSON; the data written. A benchmark's table: its commands, which write it
    (``shmtrain`` and ``python`` are this interpreter's venv's)."""
    if table.commands:
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        for command in table.commands:
            if done is not None and command in done:
                continue  # a table of the same run: its JSON is written already
            log(f"{table.name}: {command}")
            subprocess.run(command, shell=True, cwd=ROOT, check=True, env=env)
            if done is not None:
                done.add(command)
        return table.data()
    data = {"table": table.name, "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"this {os.cpu_count()}-core VM ({_cpu()})", "load": os.getloadavg()[0], "runs": {}}
    with tempfile.TemporaryDirectory(prefix="regenerate-") as tmp:
        for key, words in table.runs().items():
            out = Path(tmp) / re.sub(r"[^\w.-]+", "_", key)
            result = subprocess.run([sys.executable, "-m", "shmtrain", *words, "--out", str(out), "--no-progress"],
                                    cwd=ROOT, capture_output=True, text=True)
            if result.returncode != 0:
                raise SystemExit(f"{table.name}: {key}: shmtrain {' '.join(words)} failed:\n{result.stderr}")
            summary = json.loads((out / "summary.json").read_text())
            phases = summary["phases_ms"]
            data["runs"][key] = {"command": "shmtrain " + " ".join(words), "accuracy": summary["accuracy"],
                                 "comm_ms": phases["comm"], "iteration_ms": phases["iteration"],
                                 "wall_s": summary["wall_s"]}
            log(f"{table.name}: {key}: {summary['accuracy']:.4f}")
    (RESULTS / table.json).write_text(json.dumps(data, indent=1) + "\n")
    return data


def _cpu() -> str:
    """The CPU's model name (the last bits of a float result can differ between CPUs)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "CPU unknown"
    found = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    return found.group(1).strip() if found else "CPU unknown"


def _region(name: str) -> re.Pattern[str]:
    """A table's region: its opening comment (group 1 its indentation), the body (group 2), the end."""
    return re.compile(rf"^([ \t]*)<!-- regenerated: {re.escape(name)}\b[^\n]*-->\n(.*?)^[ \t]*<!-- end: "
                      rf"{re.escape(name)} -->", re.S | re.M)


def rewritten(table: Table, text: str) -> str:
    """``text`` (the doc) with ``table``'s region written from its JSON (indented as its comment is)."""
    match = _region(table.name).search(text)
    if match is None:
        raise SystemExit(f"{table.doc} has no region <!-- regenerated: {table.name} ... --> ... "
                         f"<!-- end: {table.name} -->")
    indent = match.group(1)
    body = "".join(indent + line + "\n" if line else "\n" for line in table.render(table.data()).split("\n"))
    return text[:match.start(2)] + body + text[match.end(2):]


def stale(names: list[str]) -> list[str]:
    """The tables among ``names`` whose doc does not hold what their JSON gives."""
    found = []
    for name in names:
        table = TABLES[name]
        text = (ROOT / table.doc).read_text()
        if rewritten(table, text) != text:
            found.append(f"{table.doc}: the table {name} differs from docs/results/{table.json}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", nargs="+", metavar="NAME", default=[],
                        help="re-run these tables' commands first (all: every table)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table differs")
    parser.add_argument("--list", action="store_true", help="list the tables and their commands")
    args = parser.parse_args(argv)
    if args.list:
        for table in TABLES.values():
            print(f"{table.name}: {table.doc}, " + ", ".join(str(json_path(f).relative_to(ROOT)) for f in table.files)
                  + (f" ({table.cost})" if table.cost else ""))
            for command in [f"shmtrain {' '.join(w)}" for w in table.runs().values()] if table.runs else table.commands:
                print(f"  {command}")
        return 0
    runs = list(TABLES) if args.run == ["all"] else args.run
    for name in runs:
        if name not in TABLES:
            parser.error(f"--run {name}: no such table; choose from {', '.join(TABLES)} or all")
    if args.check:
        problems = stale(list(TABLES))
        print("\n".join(problems) or "every table matches its JSON")
        return 1 if problems else 0
    done: set[str] = set()
    for name in runs:
        run_table(TABLES[name], done=done)
    for table in TABLES.values():
        path = ROOT / table.doc
        text = path.read_text()
        new = rewritten(table, text)
        if new != text:
            path.write_text(new)
            print(f"rewrote {table.name} in {table.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
