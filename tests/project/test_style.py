"""House style is part of the test suite: ruff must be clean."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from support.paths import ROOT


def test_ruff_is_clean() -> None:
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    result = subprocess.run([ruff, "check", "src", "tests", "examples"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


#: the size limits of the house style (STYLE.md: modules small and named for what they hold)
MODULE_LINES, FUNCTION_LINES = 450, 80


def test_modules_and_functions_stay_small() -> None:
    """No module of src/ over 450 lines, no function over 80 (decorators and docstring included)."""
    import ast

    too_big = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(ROOT)
        if text.count("\n") > MODULE_LINES:
            too_big.append(f"{name}: {text.count(chr(10))} lines (at most {MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                length = node.end_lineno - first + 1
                if length > FUNCTION_LINES:
                    too_big.append(f"{name}:{node.lineno} {node.name}: {length} lines (at most {FUNCTION_LINES})")
    assert not too_big, "\n".join(too_big)


def test_no_internal_issue_numbers_in_code_or_docs() -> None:
    """Code and docs speak of what a thing does, not of the tracker's numbers."""
    import re

    pattern = re.compile(r"\b[Ii]ssues? (#?\d+|items? \d)")
    found = []
    for folder in ("src", "docs", "examples", "tests"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in {".py", ".md", ".sh", ".toml"} and path.is_file():
                for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                    if pattern.search(line):
                        found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:80]}")
    found += [f"README.md:{n}" for n, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1)
              if pattern.search(line)]
    assert not found, "\n".join(found)
