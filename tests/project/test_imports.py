"""The import graph: no cycles, and imports only flow up the layers of
docs/architecture.md (every import counts, those inside functions too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from support.paths import ROOT

PACKAGE = ROOT / "src" / "shmtrain"

#: layer of each top-level part; a module may import only from its own layer or below
LAYERS = {
    "timing": 0, "registry": 0, "startup": 0, "memory": 0, "argtypes": 0, "typed_options": 0, "models": 0,
    "fabric": 1,
    "strategies": 2,
    "parallel": 3, "backend": 3,
    "runtime": 4, "sim": 4, "lightning": 4,
    "bench": 5, "experiments": 5, "reproduce": 5,
    "cli": 6, "__main__": 6, "fork_torchrun": 6, "fork_worker": 6,
}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                # ``from P import m`` of a submodule m is an edge to m; of any other name,
                # an edge to P itself (its __init__, which defines the name)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for target in targets:
                while target and target not in mods:
                    target = target.rsplit(".", 1)[0] if "." in target else ""
                # an import of a package's own __init__ from inside it is an edge too: the
                # __init__ runs first, and a cycle through it is as real as any other
                if target and target != name:
                    graph[name].add(target)
    return graph


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_every_part_has_a_layer():
    parts = {m.split(".")[1] for m in modules() if "." in m}
    assert parts <= set(LAYERS), f"add {sorted(parts - set(LAYERS))} to LAYERS (and docs/architecture.md)"


def test_no_import_cycles():
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_imports_flow_up_the_layers():
    upward = [
        f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
        for m, targets in import_graph().items()
        for t in targets
        if layer(m) is not None and layer(t) is not None and layer(t) > layer(m)
    ]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("module", ["shmtrain.strategies.ssgd", "shmtrain.fabric.allreduce.collectives.autotune"])
def test_the_checker_sees_real_edges(module):
    """The graph is not empty by mistake: known edges are found."""
    graph = import_graph()
    assert graph[module], module
