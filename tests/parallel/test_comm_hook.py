"""``shmtrain.ddp_comm_hook``: DDP with its buckets averaged through
shared memory gives DDP-over-gloo's weights, survives DDP's bucket rebuild, and is a
mode of ``shmtrain bench step`` / ``bench overlap``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

from shmtrain.runtime.launch.launcher import launch

STEPS = 4
BUCKET_CAP_MB = 0.001  # 262 floats: the model below spans 3 buckets after the rebuild


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def train_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    """Train the same model (same seed, same per-rank data) once per variant: ``gloo``
    (plain DDP), ``none`` (the hook registered as written, state None), ``ctx`` (an
    explicit state on the launcher's context, gradient_as_bucket_view), ``hosts`` (hosts
    of 2 workers: hierarchical, through the hosts' leaders over gloo)."""
    from torch.nn.parallel import DistributedDataParallel

    import shmtrain
    import shmtrain.parallel.comm_hook

    weights, info = {}, {}
    for variant in payload["variants"]:
        model = _model()
        ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB, gradient_as_bucket_view=variant == "ctx")
        state = {"ctx": lambda: shmtrain.ShmHookState(ctx),
                 "hosts": lambda: shmtrain.ShmHookState(local_world_size=2)}.get(variant, lambda: None)()
        if variant != "gloo":
            ddp.register_comm_hook(state, shmtrain.ddp_comm_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        gen = torch.Generator().manual_seed(ctx.rank)
        sizes = []
        for _ in range(STEPS):
            x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
            used = state
            if used is None and variant == "none":
                used = shmtrain.parallel.comm_hook.default_state()
            if used is not None:
                sizes.append(sorted((i, r.numel) for i, r in used.buckets.items()))
        if variant != "gloo":
            used = state if state is not None else shmtrain.parallel.comm_hook.default_state()
            info[variant] = {"sizes": sizes, "replaced": used.replaced,
                             "leaders": used.leaders is not None}
        weights[variant] = {k: v.clone() for k, v in model.state_dict().items()}
        if state is not None:
            state.close()
    return {"weights": weights, "info": info}


def _relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm()) for k in b)


@pytest.mark.parametrize("workers,variants", [(2, ["gloo", "none", "ctx"]), (4, ["gloo", "none", "hosts"])])
def test_same_weights_as_ddp_over_gloo(workers: int, variants: list[str]) -> None:
    results = launch("parallel.test_comm_hook:train_worker", workers, {"variants": variants}, timeout=90)
    gloo = results[0]["weights"]["gloo"]
    initial = _model().state_dict()
    assert _relative_error(gloo, initial) > 1e-3  # the steps moved the weights
    for rank, result in enumerate(results):
        for variant in variants[1:]:
            err = _relative_error(result["weights"][variant], gloo)
            assert err < 1e-5, (rank, variant, err)
    info = results[0]["info"]
    # DDP starts with one bucket and rebuilds after iteration 1: bucket 0 changes size
    # (its allreduce replaced) and new buckets appear
    none = info["none"]
    assert len(none["sizes"][0]) == 1 and len(none["sizes"][-1]) >= 3, none["sizes"]
    assert none["replaced"] >= 1 and none["sizes"][-1] == none["sizes"][1]
    if "hosts" in variants:
        assert info["hosts"]["leaders"] and not info["none"]["leaders"]


def test_bench_modes_produce_rows() -> None:
    from shmtrain.bench import overlap, step

    payload = {"model": "smallcnn", "input_shape": "1x8x8", "batch_size": 4, "rounds": 2, "warmup": 1,
               "threads": 1, "timeout": 90}
    rows = overlap.run(["nocomm", "ddp", "ddp-shm"], 2, payload)
    assert [r["mode"] for r in rows] == ["nocomm", "ddp", "ddp-shm"]
    assert all(r["median_s"] > 0 and r["vs_nocomm"] > 0 for r in rows)
    rows = step.run(["ddp-shm"], [2], dict(payload, iterations=2))
    assert rows[0]["mode"] == "ddp-shm" and rows[0]["samples"] == 4 and rows[0]["median_s"] > 0
    with pytest.raises(ValueError, match="choose from ddp, ddp-shm, "):
        step.check_modes(["ddp-shmm"])


SCRIPT = '''
import sys
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import shmtrain

dist.init_process_group("gloo")
out = {}
for hook in (False, True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001)
    if hook:
        ddp.register_comm_hook(None, shmtrain.ddp_comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        optimizer.zero_grad()
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    out[hook] = model.state_dict()
if dist.get_rank() == 1:
    torch.save(out, sys.argv[1])
dist.destroy_process_group()
'''


def test_unchanged_ddp_script_under_torchrun(tmp_path) -> None:
    """The hook as written in a plain DDP script started by torchrun (the default group
    initialised by the script, env://), against the same script without it."""
    script, out = tmp_path / "ddp_script.py", tmp_path / "w.pt"
    script.write_text(SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
           "127.0.0.1", "--master-port", str(port), str(script), str(out)]
    result = subprocess.run(cmd, timeout=120, capture_output=True, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    got = torch.load(out)
    assert _relative_error(got[True], got[False]) < 1e-5
