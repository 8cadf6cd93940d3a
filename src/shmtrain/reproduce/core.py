"""The frame every reproduction shares: a registry, the report, and its three files.

A reproduction re-runs one headline claim of a paper on this machine, scaled down
(digits or synthetic inputs shaped like the paper's, 2-4 workers), and returns a
:class:`Report`: the paper's figures beside ours, the quantity that can be compared
(usually a ratio, since absolute figures depend on the hardware), whether the claim's
direction holds, and why the absolute numbers differ. :func:`write_report` turns it
into ``NAME.md`` (for people), ``NAME.json`` (for tests and tools) and ``NAME.png``.
"""

from __future__ import annotations

import datetime
import importlib
import json
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shmtrain.registry import Registry

#: the modules (or packages, which import their modules) that register reproductions,
#: imported on first use of the registry
MODULES = ("shmcaffe", "caffegpi", "trl", "swcaffe", "shmlearn")

#: the five papers, as a reproduction's ``paper`` cites them (by authors and title; the
#: section, table or figure follows)
PAPERS = {
    "shmcaffe": 'ShmCaffe (Ahn et al., "ShmCaffe: A Distributed Deep Learning Platform with Shared Memory '
                'Buffer for HPC Architecture")',
    "caffegpi": 'CaffeGPI (Kuehn, Keuper and Pfreundt, "Using GPI-2 for Distributed Memory Paralleliziation '
                'of the Caffe Toolbox to Speed up Deep Neural Network Training")',
    "shmlearn": 'SHM-Learn-Dist (Biswas, "SHM-Learn-Dist: An optimized GPU-Powered C++ Distributed Deep '
                'Learning Library")',
    "swcaffe": 'swCaffe (You, Fang, Li et al., "swCaffe: a Parallel Framework for Accelerating Deep Learning '
               'Applications on Sunway TaihuLight")',
    "trl": 'IBM TRL (Le Duc, Sekiyama, Negishi, Imai and Kawachiya, "Accelerating Multi-GPU Deep Learning by '
           'Collecting and Accumulating Gradients on CPUs")',
}

#: the verdicts a claim can get
VERDICTS = ("reproduced", "reproduced in ratio", "not reproduced", "not reproducible here")


@dataclass
class Claim:
    """One comparable line: the paper's figure, ours, and whether the claim holds.

    ``holds`` is the claim's *direction* checked on our figures (e.g. "cpu_acc's
    collect-remaining is under 10% of synchronous SGD's collect"), not equality with the
    paper's absolute numbers.
    """

    what: str
    paper: str
    ours: str
    compare: str  # the quantity that can be compared, e.g. "speed-up 1.8x of 2 ideal"
    holds: bool
    rule: str = ""  # the check behind ``holds``, in words; a claim with a rule is one the
    # tests require to hold (also in --quick); one without is information only


@dataclass
class Report:
    """What a reproduction returns; :func:`write_report` writes it out.

    Args:
        claims: the comparable lines (at least one).
        verdict: one of :data:`VERDICTS`.
        why_differ: why our absolute figures differ from the paper's (hardware, scale).
        data: the raw measurements (goes into NAME.json under ``"data"``).
        plot: draws NAME.png from ``data`` (called with the path to write).
        notes: anything else a reader needs (settings, caveats).
    """

    claims: list[Claim]
    verdict: str
    why_differ: str
    data: dict[str, Any]
    plot: Callable[[Path], None]
    notes: list[str] = field(default_factory=list)


@dataclass
class Context:
    """What a reproduction is run with."""

    out: Path
    quick: bool
    log: Callable[[str], None] = print


@dataclass(frozen=True)
class Reproduction:
    """A registered reproduction: its name, the paper and result it re-runs, and the code."""

    name: str
    paper: str  # e.g. f"{PAPERS['shmcaffe']}, Table II"
    claim: str  # the paper's headline, in one sentence
    capabilities: tuple[str, ...]  # the capability IDs it shows (docs/capabilities.md)
    run: Callable[[Context], Report]


def _import_papers() -> None:
    for module in MODULES:
        importlib.import_module(f"shmtrain.reproduce.{module}")


#: every reproduction by name (filled by importing the paper modules, on the first lookup)
REPRODUCTIONS: Registry[Reproduction] = Registry(
    "reproduction", "reproduction", hint=" (`shmtrain reproduce --list` shows them)", fill=_import_papers)


def reproduction(name: str, paper: str, claim: str, capabilities: tuple[str, ...]
                 ) -> Callable[[Callable[[Context], Report]], Callable[[Context], Report]]:
    """Register ``run`` as reproduction ``name`` (duplicate names are refused)."""

    def register(run: Callable[[Context], Report]) -> Callable[[Context], Report]:
        REPRODUCTIONS.add(name, Reproduction(name, paper, claim, capabilities, run))
        return run

    return register


def registry() -> dict[str, Reproduction]:
    """Every reproduction by name, in name order (imports the paper modules once)."""
    return dict(sorted(REPRODUCTIONS.items().items()))


def get(name: str) -> Reproduction:
    """The reproduction ``name``, or a ValueError that lists the names."""
    return REPRODUCTIONS.get(name)


def command_line(name: str, quick: bool, out: Path) -> str:
    return f"shmtrain reproduce {name}{' --quick' if quick else ''} --out {out}"


def run_reproduction(name: str, out: Path, quick: bool = False,
                     log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run reproduction ``name`` and write ``out/NAME.{md,json,png}``; the JSON document."""
    repro = get(name)
    out.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now()
    report = repro.run(Context(out=out, quick=quick, log=log))
    if report.verdict not in VERDICTS:
        raise ValueError(f"reproduction {name}: verdict {report.verdict!r} is not one of {VERDICTS}")
    if not report.claims:
        raise ValueError(f"reproduction {name} returned no claim")
    return write_report(repro, report, out, quick, started)


def write_report(repro: Reproduction, report: Report, out: Path, quick: bool,
                 started: datetime.datetime) -> dict[str, Any]:
    """Write NAME.json, NAME.png and NAME.md (in that order: the numbers first)."""
    import os

    from shmtrain.runtime.files import write_atomic

    elapsed = (datetime.datetime.now() - started).total_seconds()
    doc = {
        "name": repro.name, "paper": repro.paper, "claim": repro.claim,
        "capabilities": list(repro.capabilities),
        "command": command_line(repro.name, quick, out), "quick": quick,
        "date": started.strftime("%Y-%m-%d"), "seconds": round(elapsed, 1),
        "machine": machine(),
        "verdict": report.verdict, "why_differ": report.why_differ, "notes": report.notes,
        "claims": [asdict(c) for c in report.claims], "data": report.data,
    }
    write_atomic(out / f"{repro.name}.json", json.dumps(doc, indent=1, default=str).encode())
    png = out / f"{repro.name}.png"
    tmp = png.with_name(f".{png.stem}.{os.getpid()}.tmp.png")
    report.plot(tmp)
    os.replace(tmp, png)
    write_atomic(out / f"{repro.name}.md", markdown(doc).encode())
    write_index(out)
    return doc


def write_index(out: Path) -> Path:
    """``out/README.md``: one row per ``NAME.json`` in ``out``: the paper's claim, our
    command, our figure, the verdict (rewritten after every reproduction)."""
    from shmtrain.runtime.files import write_atomic

    lines = [
        "# The papers' headline results, re-measured here", "",
        "Each row is one `shmtrain reproduce NAME` run on this machine (scaled down: digits or",
        "synthetic inputs shaped like the paper's, 2-4 workers on 2 CPU cores); NAME.md beside",
        "this file has the paper's figures beside ours and why the absolute figures differ.",
        "`--quick` variants of every NAME run in the default test suite (`tests/reproduce/test_reproduce.py`),",
        "which checks the direction of each claim marked with a rule.", "",
        "| NAME | paper | claim | command | ours | verdict |", "|---|---|---|---|---|---|",
    ]
    for file in sorted(out.glob("*.json")):
        try:
            doc = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or "verdict" not in doc or "claims" not in doc:
            continue
        ours = "; ".join(f"{c['what']}: {c['ours']}" for c in doc["claims"][:3])
        lines.append(f"| [{doc['name']}]({doc['name']}.md) | {doc['paper']} | {doc['claim']} | "
                     f"`{doc['command']}` ({doc['date']}, {doc['seconds']} s) | {ours} | {doc['verdict']} |")
    path = out / "README.md"
    write_atomic(path, ("\n".join(lines) + "\n").encode())
    return path


def machine() -> str:
    import os

    return f"{platform.machine()}, {os.cpu_count()} cores, Python {sys.version.split()[0]}"


def markdown(doc: dict[str, Any]) -> str:
    """NAME.md: the claim, the table paper vs ours, the verdict, why figures differ."""
    lines = [
        f"# {doc['name']}: {doc['paper']}", "",
        f"**The paper's claim.** {doc['claim']}", "",
        f"**Command.** `{doc['command']}` ({doc['date']}, {doc['seconds']} s, {doc['machine']})", "",
        "| what | paper | ours | compared | holds |", "|---|---|---|---|---|",
    ]
    for c in doc["claims"]:
        check = ("yes" if c["holds"] else "no") + (f" ({c['rule']})" if c["rule"] else "")
        lines.append(f"| {c['what']} | {c['paper']} | {c['ours']} | {c['compare']} | {check} |")
    lines += ["", f"**Verdict:** {doc['verdict']}.", "",
              f"**Why the absolute figures differ.** {doc['why_differ']}", ""]
    if doc["notes"]:
        lines += ["**Notes.**", ""] + [f"- {n}" for n in doc["notes"]] + [""]
    lines += [f"![{doc['name']}]({doc['name']}.png)", ""]
    return "\n".join(lines)
