"""Each module keeps its private names to itself, and a host is formed at one front door.

A name with a leading underscore is its module's own: another module that imports it
binds itself to what its owner may change. And the host's workers and the hosts'
leaders' group are formed by ``fabric/job/hosts.py`` alone: the context, DDP's hook, the
``shm`` backend and the transports are handed what it forms.
"""

from __future__ import annotations

import ast
from pathlib import Path

from support.paths import ROOT

PACKAGE = ROOT / "src" / "shmtrain"
FRONT_DOOR = PACKAGE / "fabric" / "job" / "hosts.py"


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_imports_another_modules_private_name() -> None:
    found = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shmtrain"):
                found += [f"{path.relative_to(PACKAGE)}:{node.lineno} imports {node.module}.{a.name}"
                          for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert not found, "\n".join(found)


def _calls(path: Path, names: set[str]) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in names:
                out.append(f"{path.relative_to(PACKAGE)}:{node.lineno} calls {name}")
    return out


def test_a_host_and_its_leaders_are_formed_in_one_module() -> None:
    formed = [c for path in _sources() if path != FRONT_DOOR for c in _calls(path, {"HostGroup"})]
    assert not formed, "form a host with fabric.job.hosts.form_host:\n" + "\n".join(formed)
    leaders = []
    for path in _sources():
        if path == FRONT_DOOR:
            continue
        text = path.read_text()
        leaders += [f"{path.relative_to(PACKAGE)}: {line.strip()}" for line in text.splitlines()
                    if "local_world for" in line and ("new_group" in line or "ProcessGroupGloo" in line)]
        leaders += [f"{path.relative_to(PACKAGE)}: {line.strip()}" for line in text.splitlines()
                    if 'PrefixStore("leaders/"' in line]
    assert not leaders, "form the leaders' group with fabric.job.hosts:\n" + "\n".join(leaders)
    assert _calls(FRONT_DOOR, {"HostGroup"}), "the front door no longer forms the host"


HIERARCHY = PACKAGE / "fabric" / "job" / "hierarchy.py"
#: the collectives a process group offers (torch.distributed's names and the group's own)
COLLECTIVES = {"all_reduce", "allreduce", "all_gather", "allgather", "all_gather_into_tensor", "broadcast",
               "gather", "scatter", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
               "alltoall", "all_to_all_single", "alltoall_base"}


def collectives_on_leaders(source: str, where: str) -> list[str]:
    """Calls of a collective on the hosts' leaders' group in ``source``: ``<...leaders>.allreduce(...)``
    or ``dist.<collective>(..., group=<...leaders>)``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in COLLECTIVES):
            continue
        receiver = ast.unparse(node.func.value)
        groups = [ast.unparse(k.value) for k in node.keywords if k.arg == "group"]
        if receiver.endswith("leaders") or any(g.endswith("leaders") for g in groups):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)[:100]}")
    return found


def test_the_hierarchy_is_composed_in_one_module() -> None:
    """Inside the host, across the leaders, back: only fabric/job/hierarchy.py calls a
    collective on the leaders' group; the exchanges hand it their host part."""
    found = [c for path in _sources() if path != HIERARCHY
             for c in collectives_on_leaders(path.read_text(), str(path.relative_to(PACKAGE)))]
    assert not found, "go through fabric.job.hierarchy.Hierarchy:\n" + "\n".join(found)
    for pattern in ("self.leaders.allreduce([result]).wait()",
                    "dist.all_reduce(view, group=self.leaders, async_op=True)",
                    "dist.broadcast(tensor, src=0, group=ctx.leaders)"):
        assert collectives_on_leaders(pattern, "example"), pattern  # the checker sees the old forms
