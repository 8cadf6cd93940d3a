"""The tests are laid out like the code: each test module in a package folder named for
the part of src/shmtrain it tests, what tests share in tests/support/, and no test module
importing another (a helper two of them need lives in support/, where a reader finds it;
an import of a test module also runs its module-level code and its imports).

Every import counts, those inside functions and in support/ too; ``conftest`` and the
modules of support/ are the allowed targets inside the tests folder. The launcher's
targets (``"fabric.smb.test_api:api_worker"``, ``--data support.data_sets:blobs``) are
strings: each one that names a module of the tests folder must name a module and a
function that exist, so a moved test cannot leave its workers behind.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from support.paths import ROOT, SUPPORT, TESTS

#: test folders that no part of src/shmtrain names, and what each holds
FOLDERS_WITHOUT_CODE = {
    "support": "the shared helpers, workers, data sets, models and scripts",
    "project": "the repository as a whole: import layers, style, private names, this layout",
    "gpu": "the CUDA tests and prove.sh",
    "core": "the modules of layer 0 (memory.py, timing.py, ...), below every part",
    "runtime/hosts": "jobs across hosts (runtime/run/torchrun.py with fabric/job/)",
    # a tests/lightning/ on the tests' path would shadow the lightning package itself
    "integrations": "shmtrain inside others' trainers: src/shmtrain/lightning/ and docs/integrations.md's recipes",
}
#: ``module:name`` strings that name a missing callable on purpose (the refusal is tested)
MISSING_ON_PURPOSE = {"support.data_sets:nothing", "support.task_data:nothing"}
TARGET = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):([A-Za-z_]\w*)(?:\.\w+)*$")


def python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def module_file(name: str) -> Path | None:
    """The file under the tests folder that ``import NAME`` would load, or None."""
    path = TESTS.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def is_test_module(name: str) -> bool:
    """Whether ``name`` is (or would be) a test module of the tests folder: it loads a
    ``test_*.py`` there, or one of its parts is ``test_*`` under a name of the tests folder
    (a module since moved or renamed)."""
    found = module_file(name)
    if found is not None:
        return found.name.startswith("test_")
    parts = name.split(".")
    ours = parts[0].startswith("test_") or module_file(parts[0]) is not None
    return ours and any(part.startswith("test_") for part in parts)


def package_of(path: Path) -> str:
    """The dotted package a module of the tests folder sits in ("" at the top)."""
    parts = list(path.relative_to(TESTS).parent.parts)
    return ".".join(parts)


def imported(source: str, package: str = "") -> list[tuple[int, str]]:
    """Every module an import in ``source`` may load, with its line: ``import a.b`` gives
    ``a.b``; ``from a import b`` gives ``a`` and ``a.b`` (b may be a module); relative
    imports are resolved against ``package``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".") if package else []
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}" if base else alias.name) for alias in node.names]
    return found


def imports_of_test_modules(source: str, package: str = "") -> list[str]:
    """The lines of ``source`` that import a test module, each as ``line: module``."""
    found: dict[int, str] = {}
    for line, name in imported(source, package):
        if name and is_test_module(name):
            found.setdefault(line, name)
    return [f"{line}: {name}" for line, name in sorted(found.items())]


def test_no_module_of_the_tests_folder_imports_a_test_module() -> None:
    found = [f"{path.relative_to(ROOT)}:{hit}"
             for path in python_files()
             for hit in imports_of_test_modules(path.read_text(), package_of(path))]
    assert not found, "import from tests/support/ instead:\n" + "\n".join(found)


def test_the_check_catches_an_import_of_a_test_module() -> None:
    bad = ("import test_gone\n"
           "from fabric.smb.test_api import api_worker\n"
           "def f():\n    from strategies import test_seams\n"
           "from . import test_remote\n")
    assert len(imports_of_test_modules(bad, "fabric.smb")) == 4, imports_of_test_modules(bad, "fabric.smb")
    fine = ("import torch\nfrom conftest import at_once\nfrom support.runs import SMALL\n"
            "from support import torchrun\nfrom shmtrain.fabric.smb import api\n")
    assert imports_of_test_modules(fine, "fabric.smb") == []


def test_test_modules_sit_in_packages_named_for_the_code() -> None:
    """No module at the top but conftest.py; each test module in a folder that has an
    ``__init__.py`` up to the tests folder (basenames may repeat across folders); each
    folder a part of src/shmtrain (a package or a module of that name), or one of
    :data:`FOLDERS_WITHOUT_CODE`; no test module in support/."""
    problems = [f"{p.name}: at the top of tests/ (only conftest.py lives there)"
                for p in TESTS.glob("*.py") if p.name != "conftest.py"]
    modules = [p for p in python_files() if p.name.startswith("test_")]
    assert len(modules) > 80
    for path in modules:
        where = path.relative_to(TESTS)
        if SUPPORT in path.parents:
            problems.append(f"{where}: a test module in support/")
            continue
        folders = [TESTS.joinpath(*where.parts[:n]) for n in range(1, len(where.parts))]
        problems += [f"{where}: {folder.relative_to(TESTS)} has no __init__.py"
                     for folder in folders if not (folder / "__init__.py").is_file()]
    code = ROOT / "src" / "shmtrain"
    for folder in sorted({p.parent for p in modules if p.parent != TESTS}):
        name = folder.relative_to(TESTS).as_posix()
        if name not in FOLDERS_WITHOUT_CODE and not (code / name).is_dir() and not (code / f"{name}.py").is_file():
            problems.append(f"tests/{name}/: no src/shmtrain/{name} (name the folder for the code it tests)")
    assert not problems, "\n".join(problems)


def targets(source: str) -> list[tuple[int, str, str]]:
    """``(line, module, name)`` of each ``module:name`` string in ``source`` that is not a
    docstring and whose module is one of the tests folder."""
    tree = ast.parse(source)
    docstrings = {id(node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            match = TARGET.match(node.value)
            if match and (module_file(match[1].split(".")[0]) is not None
                          or any(part.startswith("test_") for part in match[1].split("."))):
                found.append((node.lineno, match[1], match[2]))
    return found


def defined(path: Path) -> set[str]:
    """The names a module defines at its top: functions, classes, assignments, imports."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_every_worker_and_callable_a_test_names_exists() -> None:
    found = []
    for path in python_files():
        for line, module, name in targets(path.read_text()):
            if f"{module}:{name}" in MISSING_ON_PURPOSE:
                continue
            target = module_file(module)
            if target is None:
                found.append(f"{path.relative_to(ROOT)}:{line}: no module {module} in tests/")
            elif name not in defined(target):
                found.append(f"{path.relative_to(ROOT)}:{line}: {module} ({target.relative_to(ROOT)}) has no {name}")
    assert not found, "\n".join(found)
    every = {f"{m}:{n}" for p in python_files() for _, m, n in targets(p.read_text())}
    assert {"support.resume:resume_worker", "support.equivalence:equivalence_worker"} <= every
    assert "fabric.smb.test_api:api_worker" in every and MISSING_ON_PURPOSE <= every
