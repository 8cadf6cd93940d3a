"""The "shm" torch.distributed backend (issue 16, item 3): ``import shmtrain`` registers it,
an unchanged DDP script runs on it, and its weights equal DDP's over gloo."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_torchrun import TORCHRUN, env, free_port

pytestmark = pytest.mark.timeout(180)
SCRIPT = str(Path(__file__).with_name("ddp_backend_script.py"))


def _run(backend: str, out: Path, nodes: int = 1, per_node: int = 2, **extra: str) -> None:
    port = free_port()
    procs = [subprocess.Popen(TORCHRUN + ["--nnodes", str(nodes), "--node-rank", str(n), "--nproc-per-node",
                                          str(per_node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                                          SCRIPT, backend, str(out)],
                              env={**env(), **extra}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in range(nodes)]
    outputs = [p.communicate(timeout=150)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs


def _close(a: Path, b: Path) -> float:
    x, y = torch.load(a), torch.load(b)
    return max(float((x[k] - y[k]).norm() / x[k].norm()) for k in x)


@pytest.mark.parametrize("per_node", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ddp_on_the_shm_backend_equals_ddp_on_gloo(tmp_path: Path, per_node: int) -> None:
    _run("gloo", tmp_path / "gloo.pt", per_node=per_node)
    # on the reduction thread (where a host has cores to spare) and on the caller's thread
    _run("cpu:shm", tmp_path / "thread.pt", per_node=per_node, SHMTRAIN_PG_THREAD="1")
    _run("cpu:shm", tmp_path / "inline.pt", per_node=per_node, SHMTRAIN_PG_THREAD="0")
    assert _close(tmp_path / "gloo.pt", tmp_path / "thread.pt") < 1e-5
    assert _close(tmp_path / "gloo.pt", tmp_path / "inline.pt") < 1e-5


def test_two_hosts_reduce_hierarchically(tmp_path: Path) -> None:
    _run("gloo", tmp_path / "gloo.pt", per_node=4)
    _run("shm", tmp_path / "shm.pt", nodes=2, per_node=2)  # host sums, then gloo among leaders
    assert _close(tmp_path / "gloo.pt", tmp_path / "shm.pt") < 1e-5


@pytest.mark.parametrize("order", ["import shmtrain; import torch.distributed as dist",
                                   "import torch.distributed as dist; import shmtrain",
                                   "import shmtrain; import torch; from torch import distributed as dist"])
def test_import_shmtrain_registers_the_backend_in_either_order(order: str) -> None:
    code = f"{order}\nprint('shm' in dist.Backend.backend_list)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True", out.stderr


def test_import_shmtrain_alone_does_not_import_torch() -> None:
    code = "import sys, shmtrain; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
