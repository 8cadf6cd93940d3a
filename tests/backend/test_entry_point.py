"""The ``torch.distributed.backends`` entry point: under plain torchrun, a script that never
imports shmtrain initialises ``cpu:shm`` (torch loads the backend by its name)."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import ROOT, SUPPORT
from support.torchrun import TORCHRUN, env, free_port

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the project's tomli dependency
    import tomli as tomllib

GROUP = "torch.distributed.backends"


def declared() -> dict[str, str]:
    """The entry points pyproject.toml declares in the group."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["entry-points"][GROUP]


def test_pyproject_declares_the_backend_and_its_target_registers_it() -> None:
    assert declared() == {"shm": "shmtrain.backend:register"}
    code = ("import importlib, sys; import torch.distributed as dist; "
            "m, f = sys.argv[1].split(':'); getattr(importlib.import_module(m), f)(); "
            "assert 'SHM' in dist.Backend._plugins, dist.Backend._plugins; print('ok')")
    done = subprocess.run([sys.executable, "-c", code, declared()["shm"]], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def _metadata_path(tmp_path: Path) -> str:
    """A folder for PYTHONPATH holding the entry point as pip installs it from pyproject.toml,
    when the shmtrain installed here predates it (an editable install of an older
    checkout); empty when the installed metadata has it already."""
    if any(ep.name == "shm" for ep in importlib.metadata.entry_points(group=GROUP)):
        return ""
    info = tmp_path / "meta" / "shmtrain_backend_entry-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: shmtrain-backend-entry\nVersion: 0\n")
    lines = "".join(f"{name} = {target}\n" for name, target in declared().items())
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n{lines}")
    return str(info.parent)


@pytest.mark.parametrize("backend", ["cpu:shm", pytest.param("shm", marks=pytest.mark.slow)])
def test_plain_torchrun_initialises_the_backend_without_importing_shmtrain(tmp_path: Path, backend: str) -> None:
    run_env = env()
    extra = _metadata_path(tmp_path)
    run_env["PYTHONPATH"] = ":".join(p for p in [extra, run_env.get("PYTHONPATH", "")] if p)
    out = tmp_path / "seen.json"
    command = TORCHRUN + ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                          str(SUPPORT / "entry_point_script.py"), backend, str(out)]
    done = subprocess.run(command, env=run_env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = json.loads(out.read_text())
    assert seen["imported_before_init"] is False  # the script never imported it
    assert seen["backend"] == backend
    assert seen["sum"] == seen["expected"] == 3.0
    assert seen["through_shm"] == 1  # the allreduce went through shared memory, not gloo
