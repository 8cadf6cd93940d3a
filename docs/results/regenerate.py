"""Rewrite the docs' tables of expensive runs from their JSON in docs/results/, or re-run them first.

Run from the repository's root (the venv active, or with .venv/bin/python):

    python docs/results/regenerate.py                     # every table from its JSON; runs nothing
    python docs/results/regenerate.py --check             # exit 1 naming each table its JSON does not give
    python docs/results/regenerate.py --run diloco-outer  # re-run its commands, write its JSON, rewrite it
    python docs/results/regenerate.py --run diloco-outer diloco-compress diloco-measured   # about 3 minutes here
    python docs/results/regenerate.py --run all           # the README's benchmarks too (bench hosts: root, ~30 min)
    python docs/results/regenerate.py --list              # the tables: doc, JSON, commands

The diloco tables are ``shmtrain train`` runs that this script runs itself; the README's
benchmark tables (``bench allreduce``, ``bench checkpoint``, ``bench hosts``) come from the
JSON their benchmark writes with ``--json``. A table lies in its doc between
``<!-- regenerated: NAME ... -->`` and ``<!-- end: NAME -->``
(HTML comments: not shown); edit its JSON or re-run it, not the text between them. Each
run is one ``shmtrain train`` command, run in a fresh interpreter into a temporary folder;
its ``summary.json`` gives the figures (held-out accuracy; ``comm`` and ``iteration``
from ``phases_ms``). The accuracies are deterministic (the same bits on every run of the
same code); the milliseconds are the machine's and the day's, so the JSON keeps the
date, the cores and the load average with them. ``tests/test_docs.py`` runs ``--check``.
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

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"


@dataclasses.dataclass(frozen=True)
class Table:
    """One generated region of a doc: its runs (key -> the words after ``shmtrain``) and how
    the JSON of those runs is written as markdown."""

    name: str
    doc: str
    json: str
    runs: Callable[[], dict[str, list[str]]] | None
    render: Callable[[dict], str]
    #: a benchmark that writes the JSON itself (the words after ``shmtrain``), in place of ``runs``
    bench: tuple[str, ...] = ()


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
    from shmtrain.fabric.compress import Codec, parse_compress

    params = 151_306  # smallcnn on digits (tests/test_docs.py checks it)
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


TABLES = {t.name: t for t in [
    Table("diloco-outer", "docs/diloco.md", "diloco-outer.json", outer_runs, render_outer),
    Table("diloco-compress", "docs/diloco.md", "diloco-compress.json", compress_runs, render_compress),
    Table("diloco-measured", "docs/diloco.md", "diloco-measured.json", measured_runs, render_measured),
    Table("bench-allreduce", "README.md", "bench_allreduce.json", None, render_allreduce,
          ("bench", "allreduce", "--json", "docs/results/bench_allreduce.json")),
    Table("bench-checkpoint", "README.md", "bench_checkpoint.json", None, render_checkpoint,
          ("bench", "checkpoint", "--model", "smallcnn", "resnet18", "resnet50", "--reps", "5", "--json",
           "docs/results/bench_checkpoint.json")),
    Table("bench-hosts", "README.md", "bench_hosts_tta.json", None, render_hosts,
          ("bench", "hosts", "--repeat", "3", "--json", "docs/results/bench_hosts_tta.json", "--plot",
           "docs/figures/bench_hosts_tta.png")),
]}


# -- running, rewriting, checking ---------------------------------------------------------------------
def run_table(table: Table, log: Callable[[str], None] = print) -> dict:
    """Run every command of ``table`` (one after another, each in a fresh interpreter) and
    write its JSON; the data written. A benchmark's table: its one command, which writes it."""
    if table.bench:
        log(f"{table.name}: shmtrain {' '.join(table.bench)}")
        subprocess.run([sys.executable, "-m", "shmtrain", *table.bench], cwd=ROOT, check=True)
        return json.loads((RESULTS / table.json).read_text())
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
    return re.compile(rf"(<!-- regenerated: {re.escape(name)}\b[^\n]*-->\n)(.*?)(<!-- end: {re.escape(name)} -->)",
                      re.S)


def rewritten(table: Table, text: str) -> str:
    """``text`` (the doc) with ``table``'s region written from its JSON."""
    match = _region(table.name).search(text)
    if match is None:
        raise SystemExit(f"{table.doc} has no region <!-- regenerated: {table.name} ... --> ... "
                         f"<!-- end: {table.name} -->")
    body = table.render(json.loads((RESULTS / table.json).read_text())) + "\n"
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
            print(f"{table.name}: {table.doc}, docs/results/{table.json}")
            for words in table.runs().values() if table.runs else [table.bench]:
                print(f"  shmtrain {' '.join(words)}")
        return 0
    runs = list(TABLES) if args.run == ["all"] else args.run
    for name in runs:
        if name not in TABLES:
            parser.error(f"--run {name}: no such table; choose from {', '.join(TABLES)} or all")
    if args.check:
        problems = stale(list(TABLES))
        print("\n".join(problems) or "every table matches its JSON")
        return 1 if problems else 0
    for name in runs:
        run_table(TABLES[name])
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
