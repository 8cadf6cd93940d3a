"""Workers keep freed memory (shmtrain.memory): the tensors a training step frees
and allocates again every iteration reuse the same pages instead of faulting in fresh
ones (ResNet-18, batch 32 of 3x64x64, one thread: ~11,000 faults per step with malloc's
defaults on the development machine, 0 with the memory kept)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROBE = """
import resource, sys, torch
from torch import nn
from shmtrain.memory import keep_freed_memory
applied = keep_freed_memory()
torch.set_num_threads(1)
from torchvision.models import resnet18
model = resnet18(num_classes=10)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x, y = torch.randn(32, 3, 64, 64), torch.randint(0, 10, (32,))
def step():
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
for _ in range(4):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    step()
print(applied, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 3)
"""


def _faults_per_cycle(keep: str) -> tuple[bool, int]:
    env = dict(os.environ, SHMTRAIN_KEEP_FREED_MEMORY=keep)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.slow  # ~20 s of page-fault counting
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning")
def test_freed_memory_is_reused_without_page_faults() -> None:
    applied, kept = _faults_per_cycle("1")
    assert applied
    assert kept < 2500, f"{kept} page faults per training step with freed memory kept"
    applied, default = _faults_per_cycle("0")
    assert not applied
    # the control: malloc's defaults trim the freed top of the heap, so fresh pages every step
    assert default > 4 * kept and default > 5000, f"{default} faults per step with malloc's defaults, {kept} kept"
