"""The docs a fresh clone can trust: README.md, docs/**/*.md and every ``--help`` name no
path outside the repository, no file it lacks and no internal issue; every option of every
``--help`` says what it does; the tables of expensive runs are what their JSON in
docs/results/ gives (``docs/results/regenerate.py``); and each cheap figure is what its
command gives, within the tolerance stated beside it in FIGURES."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from conftest import run_main

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "shmtrain"
#: the repository's own top-level folders, and shmtrain's packages (a module path such as
#: runtime/launch/job_dir.py is relative to src/shmtrain)
REPO_DIRS = ("src", "docs", "tests", "examples", "tools")
#: bare file names the docs use for the reader's own files or a run's outputs, not the repository's
USER_FILES = {"mydata.py", "script.py", "train.py", "run.toml", "file.json", "mynet.py", "own_loop.py",
              "net.py", "mymodel.py", "mytask.py", "setup.py", "conftest.py", "distributed_test.py",
              "run_test.py", "__main__.py", "api.py", "model_average.py"}


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@cache
def help_texts() -> dict[str, str]:
    """``shmtrain ... --help`` of every command and sub-command (torchrun's own help is torchrun's)."""
    from shmtrain.cli import build_parser

    texts = {}

    def walk(parser: argparse.ArgumentParser, words: list[str]) -> None:
        texts[" ".join(["shmtrain", *words, "--help"])] = parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    if name != "torchrun" and sub.add_help:
                        walk(sub, [*words, name])

    walk(build_parser(None), [])
    return texts


@cache
def repo_files() -> frozenset[str]:
    """Every file of the checkout, as a path relative to its root (what git tracks, and what
    this checkout adds that git would track)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return frozenset(p for p in listed if (ROOT / p).exists())


# -- what a line may not say -------------------------------------------------------------------------
OUTSIDE = [
    (re.compile(r"\.\./shared\b|\bshared/(?:papers|DESIGN|BASELINES|STYLE)"), "a path outside the repository"),
    (re.compile(r"\b(?:BASELINES|DESIGN|STYLE)\.md\b"), "a file outside the repository"),
    (re.compile(r"(?<![\w.~-])/(?:work|root|home/[a-z]+/(?!runs\b)|\.\.\.)(?:/|\b)"),
     "an absolute path of one machine"),
    (re.compile(r"/tmp/(?:pytest-of|tmp\w{6,}|dm/|bash_jobs)"), "a temporary path of one machine"),
    (re.compile(r"\b\d{3}_[0-9a-f]{16}\.txt\b|\bpapers/\d{3}_|\b00\d_…"),
     "a paper by its storage name (cite its authors, title, section and figure)"),
    (re.compile(r"\b[Tt]he issue\b|\b[Ii]ssue'?s?\s*#?\d+|(?<![a-zA-Z])issue_?\d+|\b[Tt]his issue\b|\b[Ii]ssue's\b"),
     "an internal issue"),
    (re.compile(r"(?<![\w#])(?<!reduction )(?<!all_reduce )(?<!call )#\d+\b"), "an internal issue number"),
    (re.compile(r"\b[Ss]ession \d+\b|\bitems? \d+\b(?! of)"), "a step of the project's own work, not of the code"),
]
#: what a command writes (``--json docs/results/new.json``) need not exist before it runs
WRITTEN = re.compile(r"(?:--(?:json|plot|out|record)|>)\s+$")
PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w.-]+\.(?:py|md|c|h|sh|json|png|toml|txt|jsonl))(?:::(\w+))?(?![\w/])")


def _expand(path: str) -> list[str]:
    """``a_{1,2}.json`` -> ``a_1.json``, ``a_2.json``."""
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    return [p for part in match.group(1).split(",") for p in _expand(path[:match.start()] + part + path[match.end():])]


def missing(path: str, where: Path | None) -> bool:
    """Whether ``path`` (a repository path, a module path under src/shmtrain, or one relative to the
    doc's folder) names no file of the checkout."""
    files = repo_files()
    first = path.split("/")[0]
    if "/" not in path:
        if path in USER_FILES or not path.endswith((".py", ".c", ".h", ".sh")):
            return False  # a run's output (summary.json), or the reader's own file
        return not any(f == path or f.endswith("/" + path) for f in files)
    if first in ("torch", "torchvision", "test", "RUN_DIR", "DIR", "runs", "data", "mypkg", "metrics", "checkpoints",
                 "logs", "..", "") or "<" in path:
        return False  # another package's file, or a path the reader or a run makes
    candidates = [path, f"src/shmtrain/{path}"]
    if where is not None:
        candidates.append(str((where.parent / path).resolve().relative_to(ROOT)) if (
            where.parent / path).resolve().is_relative_to(ROOT) else path)
    if first in REPO_DIRS or any(c in files for c in candidates):
        return not any(c in files or (ROOT / c).is_dir() for c in candidates)
    return not any(f.endswith("/" + path) for f in files)  # e.g. collectives/transport.py under fabric/


@cache
def _test_names(path: str) -> frozenset[str]:
    return frozenset(re.findall(r"^\s*def (test_\w+)", (ROOT / path).read_text(), re.M))


def problems(text: str, where: Path | None = None) -> Iterator[str]:
    """What is wrong with each line of ``text`` (a doc at ``where``, or a --help text)."""
    for number, line in enumerate(text.splitlines(), 1):
        for pattern, what in OUTSIDE:
            found = pattern.search(line)
            if found:
                yield f"{number}: {what}: {found.group(0)!r} in: {line.strip()[:120]}"
        for match in PATH.finditer(line):
            if WRITTEN.search(line[:match.start()]) or line[:match.start()].endswith(("$", "$OUT/")):
                continue
            for path in _expand(match.group(1)):
                if missing(path, where):
                    yield f"{number}: no such file: {path} in: {line.strip()[:120]}"
                elif match.group(2) and path.startswith("tests/") and match.group(2) not in _test_names(path):
                    yield f"{number}: no test {match.group(2)} in {path}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("doc", [p.relative_to(ROOT).as_posix() for p in doc_files()])
def test_a_doc_names_nothing_outside_the_repository_nor_a_missing_file_nor_an_issue(doc: str) -> None:
    found = list(problems((ROOT / doc).read_text(), ROOT / doc))
    assert not found, f"{doc}:\n" + "\n".join(found)


@pytest.mark.timeout(120)
def test_every_help_text_names_nothing_outside_the_repository_nor_a_missing_file_nor_an_issue() -> None:
    found = [f"{command}: {p}" for command, text in help_texts().items() for p in problems(text)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("line", [
    "see ../shared/DESIGN.md for the direction", "BASELINES.md measures it", "PYTHONPATH=/work/main/src python",
    "PYTHONPATH=/.../src python -m shmtrain", "in /root/.cache/x", "ShmCaffe (`papers/003_…`, Section V-A)",
    "CaffeGPI (001_f88734fd480eba64.txt), Figs. 5", "fixed in issue" " 12", "see #12", "the issue's goal",
    "bench_overlap_issue26.json", "`src/shmtrain/fabric/nothere.py`", "`fabric/smb/nothere.py`",
    "`tests/test_docs.py::test_that_is_not_there`", "`docs/nothere.md`", "`examples/gone.py`",
])
def test_the_scan_catches_each_kind_of_bad_reference(line: str) -> None:
    assert list(problems(line, ROOT / "docs" / "x.md")), line


@pytest.mark.parametrize("line", [
    "did not reach reduction #3807 within 120 s", "`all_reduce #2 failed on this rank`",
    "shmtrain reproduce all --quick --out /tmp/r", "`fabric/smb/gate.py`, `runtime/launch/job_dir.py`",
    "`tests/project/test_docs.py::test_the_scan_catches_each_kind_of_bad_reference`",
    "RUN_DIR/config.toml, summary.json",
    "`docs/results/bench_overlap_resnet18_{1,2,3}.json`", "every call is issued in order", "`mydata.py:37`",
    "SHMTRAIN_TRUSTED=/home/alice/runs/a shmtrain evaluate /home/alice/runs/a", "[trl-table3](trl-table3.md)",
])
def test_the_scan_passes_what_is_right(line: str) -> None:
    assert not list(problems(line, ROOT / "docs" / "reproduction" / "README.md")), line


def test_every_option_of_every_help_says_what_it_does() -> None:
    from shmtrain.cli import build_parser

    bare = []

    def walk(parser: argparse.ArgumentParser, words: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    if name != "torchrun" and sub.add_help:
                        walk(sub, [*words, name])
            elif action.help != argparse.SUPPRESS:
                text = re.sub(r"\(default[^)]*\)|\[[^\]]*default[^\]]*\]", "", action.help or "").strip()
                if not text:
                    bare.append(f"shmtrain {' '.join(words)} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(None), [])
    assert not bare, "options without an explanation: " + ", ".join(bare)


# -- the tables of expensive runs ---------------------------------------------------------------------
@cache
def _regenerate():
    """docs/results/regenerate.py, imported."""
    spec = importlib.util.spec_from_file_location("regenerate", ROOT / "docs" / "results" / "regenerate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["regenerate"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_the_tables_of_expensive_runs_are_what_their_json_gives() -> None:
    """``python docs/results/regenerate.py --check``: a figure edited by hand in such a table fails."""
    regenerate = _regenerate()
    assert not regenerate.stale(list(regenerate.TABLES))


def test_a_table_edited_by_hand_no_longer_matches_its_json() -> None:
    """Every generated table, its first figure and its last row's last figure edited in turn."""
    regenerate = _regenerate()
    for table in regenerate.TABLES.values():
        text = (ROOT / table.doc).read_text()
        body = regenerate._region(table.name).search(text)
        rows = re.search(r"^[ \t]*\|---.*$", body.group(2), re.M)  # the figures start after the header
        offset = body.start(2) + rows.end()
        figures = list(re.finditer(r"\d+\.\d+|\d[\d,]*", text[offset:body.end(2)]))
        assert figures, f"{table.name}: no figure in its table"
        for figure in (figures[0], figures[-1]):
            start, end = offset + figure.start(), offset + figure.end()
            edited = text[:start] + str(int(figure.group(0).replace(",", "").split(".")[0]) + 7) + text[end:]
            assert regenerate.rewritten(table, edited) != edited, f"{table.name}: {figure.group(0)} edited"


def test_every_table_of_the_docs_names_its_json_and_command(capsys) -> None:
    """``regenerate.py --list``: each table's JSON exists, and each has a command that makes it again."""
    regenerate = _regenerate()
    assert regenerate.main(["--list"]) == 0
    listed = capsys.readouterr().out
    for table in regenerate.TABLES.values():
        assert f"{table.name}: {table.doc}, " in listed, table.name
        assert table.runs or table.commands, table.name
        assert all(regenerate.json_path(f).is_file() for f in table.files), table.name
        assert f"<!-- regenerated: {table.name} " in (ROOT / table.doc).read_text(), table.name


def test_the_reproductions_index_is_what_their_json_gives(tmp_path: Path) -> None:
    """docs/reproduction/README.md is ``write_index`` of the NAME.json beside it (``shmtrain
    reproduce`` rewrites it after every run): a figure edited by hand there fails."""
    import shutil

    from shmtrain.reproduce.core import write_index

    for path in (ROOT / "docs" / "reproduction").glob("*.json"):
        shutil.copy(path, tmp_path / path.name)
    index = (ROOT / "docs" / "reproduction" / "README.md").read_text()
    assert write_index(tmp_path).read_text() == index


def test_each_reproduction_is_what_its_json_gives() -> None:
    """docs/reproduction/NAME.md is ``markdown`` of NAME.json (``shmtrain reproduce NAME`` writes
    both, the command and date in it): a figure edited by hand in NAME.md fails."""
    from shmtrain.reproduce.core import markdown

    found = sorted((ROOT / "docs" / "reproduction").glob("*.json"))
    assert found
    for path in found:
        doc = json.loads(path.read_text())
        assert markdown(doc) == path.with_suffix(".md").read_text(), f"{path.with_suffix('.md').name} differs from " \
            f"{path.name}: run `{doc['command']}` again, or edit neither by hand"


# -- the cheap figures, each run by its command here ----------------------------------------------------
@dataclass(frozen=True)
class Figure:
    """Numbers a doc states (``pattern``'s groups) and the command that gives them: ``measure``
    runs it (in a scratch folder) and returns the same numbers, to agree within ``tolerance``."""

    name: str
    doc: str
    pattern: str
    command: str
    measure: Callable[[Path], tuple[float, ...]]
    tolerance: float


def _train(out: Path, *words: str) -> dict:
    done = run_main("train", *words, "--out", str(out), "--no-progress")
    assert done.returncode == 0, done.stderr
    return json.loads((out / "summary.json").read_text())


def _regression(tmp: Path) -> tuple[float, ...]:
    summary = _train(tmp / "run", "--task", "regression", "--data", "examples.regression:diabetes", "--model",
                     "examples.regression:Net", "--workers", "2", "--batch-size", "16", "--epochs", "20")
    return (summary["rmse"],)


def _image_folder(tmp: Path) -> tuple[float, ...]:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from make_image_folder import make
    finally:
        sys.path.remove(str(ROOT / "examples"))
    make(tmp / "shapes")  # python examples/make_image_folder.py data/shapes: its defaults
    out = tmp / "run"
    summary = _train(out, "--model", "examples.mynet:Net", "--data", str(tmp / "shapes" / "train"),
                     "--val-data", str(tmp / "shapes" / "val"), "--transform", "normalize", "--optimizer", "adamw",
                     "--lr", "3e-3", "--grad-clip", "1.0", "--accumulate", "2", "--epochs", "20", "--batch-size",
                     "16", "--workers", "2")
    evals = {row["eval"]["iteration"]: row["eval"]["accuracy"] for row in map(
        json.loads, (out / "metrics" / "rank-0.jsonl").read_text().splitlines()) if "eval" in row}
    return 100 * summary["accuracy"], summary["iterations"], 100 * evals[70]


def _diloco_defaults(tmp: Path) -> tuple[float, ...]:
    summary = _train(tmp / "run", "--workers", "4", "--batch-size", "16", "--iterations", "400", "--seed", "3",
                     "--strategy", "diloco", "--sync-every", "8")
    return (summary["accuracy"],)


def _parameters(name: str, shape: tuple[int, ...] = (1, 8, 8)) -> Callable[[Path], tuple[float, ...]]:
    def count(tmp: Path) -> tuple[float, ...]:
        from shmtrain.models.registry import build_model

        return (sum(p.numel() for p in build_model(name, shape, 10).parameters()),)

    return count


def _compressed_bytes(tmp: Path) -> tuple[float, ...]:
    from shmtrain.fabric.compress.codec import Codec, parse_compress

    spec = parse_compress("topk:0.01,bits:4")
    return Codec(151_306, spec).nbytes, Codec(1_124_450, spec).nbytes


def _test_counts(tmp: Path) -> tuple[float, ...]:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    found = re.search(r"^(\d+)/(\d+) tests collected \((\d+) deselected\)", done.stdout, re.M)
    assert found, done.stdout[-2000:] + done.stderr[-2000:]
    return int(found.group(1)), int(found.group(3))


FIGURES = [
    Figure("regression-rmse", "README.md", r"held-out rmse ([\d.]+) standard deviations here",
           "shmtrain train --task regression --data examples.regression:diabetes --model examples.regression:Net "
           "--workers 2 --batch-size 16 --epochs 20", _regression, 0.01),
    Figure("image-folder", "README.md",
           r"it reached ([\d.]+)% held-out accuracy in (\d+)\s+iterations \(after 10 epochs, 70 iterations: ([\d.]+)%",
           "python examples/make_image_folder.py data/shapes; the README's shmtrain train --model examples.mynet:Net",
           _image_folder, 3.4),  # two images of the 60 held out: 85.00% at 70 iterations where the docs were
    # measured, 81.67% on an AMD EPYC VM without AVX-512 (2026-12-02): torch's CPU kernels round by instruction set
    Figure("diloco-defaults", "docs/diloco.md", r"With no outer flag \(the default outer step\): H = 8 ([\d.]+)",
           "shmtrain train --workers 4 --batch-size 16 --iterations 400 --seed 3 --strategy diloco --sync-every 8",
           _diloco_defaults, 0.009),  # three images of the 359 held out: 0.9805 where the docs were
    # measured, 0.9889 on an AMD EPYC VM without AVX-512 (2026-12-02): torch's CPU kernels round by instruction set
    Figure("smallcnn-parameters", "docs/collectives.md", r"\(`smallcnn`, ([\d,]+) parameters\)",
           "sum of numel of smallcnn's parameters on digits", _parameters("smallcnn"), 0),
    Figure("smallcnn-P", "docs/diloco.md", r"For the default `smallcnn` on digits \(P = ([\d,]+)\)",
           "sum of numel of smallcnn's parameters on digits", _parameters("smallcnn"), 0),
    Figure("wide-mlp-P", "docs/diloco.md", r"`wide_mlp` on\s+digits, P = ([\d,]+),",
           "sum of numel of wide_mlp's parameters on digits", _parameters("wide_mlp"), 0),
    Figure("compressed-bytes", "docs/diloco.md",
           r"`smallcnn` \(P = 151,306\) ([\d,]+) bytes per outer step instead of 605 kB;\s+`wide_mlp` "
           r"\(P = 1,124,450\) ([\d,]+) instead", "Codec(P, topk:0.01,bits:4).nbytes", _compressed_bytes, 0),
    Figure("test-counts", "README.md", r"runs (\d+) tests and leaves out the (\d+) marked `slow`",
           "pytest --collect-only -q", _test_counts, 0),
]


def documented(figure: Figure, text: str) -> tuple[float, ...]:
    found = re.search(figure.pattern, text)
    assert found, f"{figure.doc} no longer says /{figure.pattern}/ ({figure.name}): update FIGURES in {__file__}"
    return tuple(float(g.replace(",", "")) for g in found.groups())


def mismatches(figure: Figure, says: tuple[float, ...], gives: tuple[float, ...]) -> list[str]:
    return [f"{figure.doc} says {d:g} where `{figure.command}` gives {m:g} (tolerance {figure.tolerance:g}): "
            f"write {m:g} there" for d, m in zip(says, gives, strict=True) if abs(d - m) > figure.tolerance]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("figure", FIGURES, ids=[f.name for f in FIGURES])
def test_a_cheap_figure_is_what_its_command_gives(figure: Figure, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)  # the docs' commands run from the repository's root (examples/ importable)
    says = documented(figure, (ROOT / figure.doc).read_text())
    assert not mismatches(figure, says, figure.measure(tmp_path)), mismatches(figure, says, figure.measure(tmp_path))


@pytest.mark.parametrize("figure", FIGURES, ids=[f.name for f in FIGURES])
def test_a_cheap_figure_edited_in_its_doc_fails_its_check(figure: Figure) -> None:
    text = (ROOT / figure.doc).read_text()
    says = documented(figure, text)
    found = re.search(figure.pattern, text)
    old = found.group(1)
    new = says[0] + 10 * figure.tolerance + 1
    new_text = f"{new:.{len(old.split('.')[1])}f}" if "." in old else f"{int(new):,}" if "," in old else str(int(new))
    edited = text[:found.start(1)] + new_text + text[found.end(1):]
    assert mismatches(figure, documented(figure, edited), says)


def test_the_simulator_block_of_collectives_is_what_the_command_prints() -> None:
    """docs/collectives.md's ``$ shmtrain sim allreduce ...`` block is its output (the cost model
    is deterministic): a predicted time edited there fails."""
    text = (ROOT / "docs" / "collectives.md").read_text()
    block = re.search(r"^\$ shmtrain (sim allreduce [^\n]+)\n(.*?)^```", text, re.M | re.S)
    done = run_main(*block.group(1).split())
    assert done.returncode == 0, done.stderr
    assert done.stdout == block.group(2), "docs/collectives.md: write there what it prints:\n" + done.stdout


# -- what the documented commands leave in a clone ---------------------------------------------------
#: what commands write into the current folder by default (shmtrain reproduce, compare, smb-server,
#: shmtrain run's logs, train's run folders, the GPU proof)
DEFAULT_OUTPUTS = ["reproduction/x.md", "compare.png", "smb-server/smb-snapshot.pt", "shmtrain-logs/x/rank-0.log",
                   "runs/x/summary.json", "gpu-proof/proof.tgz", "data/shapes/train/a.png"]


def test_what_the_documented_commands_write_into_a_clone_is_ignored() -> None:
    written = set(DEFAULT_OUTPUTS)
    for doc in doc_files():
        for match in re.finditer(r"--(?:json|out|ckpt|plot)\s+([\w.-]+(?:/[\w.-]*)?)", doc.read_text()):
            path = match.group(1)
            if not path.startswith(("docs", "/", "DIR", "FILE", "runs", "F")) and not path.isupper():
                written.add(path.rstrip("/") + ("/x" if path.endswith("/") else ""))
    done = subprocess.run(["git", "check-ignore", "--no-index", "-v", "--non-matching", *sorted(written)], cwd=ROOT,
                          capture_output=True, text=True)
    tracked = [line.split("\t")[-1] for line in done.stdout.splitlines() if line.startswith("::")]
    assert not tracked, f"add these to .gitignore (documented commands write them into a clone): {tracked}"
