"""Shared test fixtures: leak checks for shared memory and child processes.

Worker functions started by :func:`shmtrain.runtime.launcher.launch` are named
``"test_module:function"``; the tests folder is put on PYTHONPATH so workers import them.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import psutil
import pytest

from shmtrain.fabric.segment import leftover

TESTS = Path(__file__).parent
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in [str(TESTS), os.environ.get("PYTHONPATH", "")] if p
)
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


def _children() -> list[psutil.Process]:
    try:
        return [p for p in psutil.Process().children(recursive=True) if p.is_running()]
    except psutil.Error:
        return []


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail the test if it leaves a shmtrain segment in /dev/shm or a child process."""
    before = set(leftover())
    yield
    deadline = time.monotonic() + 5.0
    while True:
        segments = sorted(set(leftover()) - before)
        children = [p for p in _children() if p.status() != psutil.STATUS_ZOMBIE]
        if not segments and not children or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for child in children:
        child.kill()
    # Leaked names are reported, not removed: another shmtrain run on this machine may
    # own a name in its set-up window, and removing it would break that run.
    assert not segments, f"leaked shared-memory segments: {segments}"
    assert not children, f"leaked child processes: {[c.pid for c in children]}"
