"""The recipes of docs/integrations.md, each read from the doc and run under torchrun on 2
processes: as written (on ``cpu:shm``, or with ``shmtrain.DataParallel``) and with gloo (or
Accelerate's DDP) in its place; the weights agree, and the runs on the backend went through
shared memory."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

from support.paths import ROOT
from support.torchrun import TORCHRUN, env, free_port

DOC = ROOT / "docs" / "integrations.md"
#: appended to each run: how many tensors each rank reduced through the shm backend
#: then the process ends without the interpreter's teardown, where torch 2.14 can abort a
#: gloo job that made an optimizer, with or without shmtrain (tests/support/script_exit.py)
REPORT = """
import os as _os, sys as _sys
_group = _sys.modules.get("shmtrain.backend.group")
open(f"reductions-{_os.environ['RANK']}", "w").write(str(_group.ShmBackend.reductions if _group else 0))
_sys.stdout.flush(); _sys.stderr.flush(); _os._exit(0)
"""
DP_LINE = 'model = shmtrain.DataParallel(net, optimizer, strategy="ssgd")'


def recipe(name: str) -> str:
    """The code block after ``<!-- recipe: NAME -->`` in docs/integrations.md."""
    found = re.search(rf"<!-- recipe: {re.escape(name)} -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    assert found, f"docs/integrations.md has no recipe {name!r}"
    return found.group(1)


def run(cases: dict[str, str], tmp_path: Path) -> dict[str, tuple[dict[str, torch.Tensor], list[int]]]:
    """Run each ``name: code`` at once under torchrun (2 processes) in a folder of its own:
    rank 0's ``model.pt``, and the tensors each rank reduced through the shm backend."""
    procs = {}
    for key, code in cases.items():
        where = tmp_path / key
        where.mkdir()
        (where / "recipe.py").write_text(code + REPORT)
        command = TORCHRUN + ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                              str(free_port()), "recipe.py"]
        procs[key] = (subprocess.Popen(command, cwd=where, env=env(), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True), where)
    results = {}
    for key, (proc, where) in procs.items():
        out = proc.communicate(timeout=170)[0]
        assert proc.returncode == 0, (key, out[-6000:])
        counts = [int((where / f"reductions-{r}").read_text()) for r in (0, 1)]
        results[key] = (torch.load(where / "model.pt"), counts)
    return results


def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).norm() / max(float(a[k].double().norm()), 1e-12)) for k in a)


@pytest.mark.parametrize("name", ["accelerate", pytest.param("transformers", marks=pytest.mark.slow)])
def test_a_trainer_on_the_backend_equals_gloo(tmp_path: Path, name: str) -> None:
    pytest.importorskip(name, reason=f"{name} is not installed (pip install -e '.[test]')")
    code = recipe(name)
    assert '"cpu:shm"' in code
    done = run({"shm": code, "gloo": code.replace('"cpu:shm"', '"gloo"')}, tmp_path)
    (shm, through), (gloo, none) = done["shm"], done["gloo"]
    assert rel(gloo, shm) < 1e-6, name  # batch-norm buffers included
    assert all(n > 0 for n in through) and none == [0, 0]  # the allreduces went through shared memory


def test_dataparallel_in_an_accelerate_loop_equals_accelerates_ddp(tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="accelerate is not installed (pip install -e '.[test]')")
    code = recipe("accelerate-dataparallel")
    assert DP_LINE in code and "model.close()" in code
    ddp = "\n".join("model, optimizer = accelerator.prepare(net, optimizer)" if line.startswith(DP_LINE) else line
                    for line in code.splitlines() if line != "model.close()")
    done = run({"shmtrain": code, "ddp": ddp}, tmp_path)
    ours, theirs = done["shmtrain"][0], done["ddp"][0]
    assert rel(theirs, ours) < 1e-6
    torch.manual_seed(0)  # the recipe's initial first layer: the runs trained
    assert float((torch.nn.Linear(12, 32).weight.detach() - ours["0.weight"]).norm()) > 1e-2
