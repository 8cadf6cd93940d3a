"""Shared test fixtures: leak checks for shared memory and child processes.

The test modules live in packages named like src/shmtrain's parts (``fabric/smb/``,
``runtime/launch/``, ...), their shared helpers in ``support/``. Worker functions started
by :func:`shmtrain.runtime.launch.launcher.launch` are named by module path from this
folder (``"fabric.smb.test_api:api_worker"``, ``"support.resume:resume_worker"``); the
tests folder is put on sys.path and PYTHONPATH so workers import them.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from shmtrain.fabric.shm.segment import leftover

TESTS = Path(__file__).parent
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in [str(TESTS), os.environ.get("PYTHONPATH", "")] if p
)
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


def _children() -> list[psutil.Process]:
    """This process's descendants, but its worker zygote (``runtime/launch/zygote.py``), which
    lives as long as the test session by design; the workers it forked still count."""
    from shmtrain.runtime.launch import zygote

    spared = zygote.pid()
    try:
        return [p for p in psutil.Process().children(recursive=True) if p.is_running() and p.pid != spared]
    except psutil.Error:
        return []


def worker_rank(process: psutil.Process) -> int | None:
    """The rank of a worker process (forked by a zygote: named ``shmtrain-w<r>``; started
    fresh: ``RANK`` in its environment), None for any other process."""
    try:
        name = process.name()
        if name.startswith("shmtrain-w"):
            return int(name[len("shmtrain-w"):])
        if "shmtrain.runtime.launch.worker" in " ".join(process.cmdline()):
            return int(process.environ()["RANK"])
    except (psutil.Error, KeyError, ValueError):
        pass
    return None


def run_main(*words: str) -> subprocess.CompletedProcess:
    """``shmtrain WORDS`` through :func:`shmtrain.cli.main` in this process (its workers
    forked from this process's warm zygote, no new interpreter): the exit status and what
    the command printed."""
    from shmtrain.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(words))
    return subprocess.CompletedProcess(["shmtrain", *words], code, out.getvalue(), err.getvalue())


def at_once(commands: dict[Any, tuple[list[str], dict[str, str] | None]],
            timeout: float = 60) -> dict[Any, subprocess.CompletedProcess]:
    """Run each ``key: (argv, env)`` at the same time (each a fresh interpreter importing
    torch: on 2 cores, about half the time of one after another); their results by key."""
    procs = {key: subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for key, (argv, env) in commands.items()}
    done = {}
    for key, proc in procs.items():
        out, err = proc.communicate(timeout=timeout)
        done[key] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (its workers, and a zygote between them)."""
    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def worker_process(pid: int, rank: int, timeout: float = 30.0) -> psutil.Process:
    """The worker of ``rank`` under launcher ``pid``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for process in psutil.Process(pid).children(recursive=True):
            if worker_rank(process) == rank:
                return process
        time.sleep(0.1)
    raise AssertionError(f"no worker of rank {rank} under pid {pid}")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the ``shm`` backend's C++ front before the first test (about a minute on a fresh
    machine): built inside a test, its rank processes would spend that test's timeout on it."""
    from shmtrain.backend import front

    front.module()


@pytest.fixture(autouse=True)
def cpu_unless_a_cuda_test(request, monkeypatch):
    """On a GPU host, hide the GPUs from every test but the CUDA ones (``tests/gpu/test_cuda.py``,
    and tests named ``*cuda*``): ``--device auto``, the default, would move their CLI runs
    and workers to the GPU, where their CPU references (weights within 1e-5) do not hold.
    The workers inherit it (the zygote forks each with the launcher's environment)."""
    if request.node.path.name != "test_cuda.py" and "cuda" not in request.node.name:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    yield


#: the shmtrain names in /dev/shm when the running test began (other jobs' on this machine)
_BEFORE: set[str] = set()


def new_segments() -> list[str]:
    """The shmtrain names in /dev/shm that were not there when this test began: what a test
    judges as its own leak (another job of this machine may hold names of its own)."""
    return sorted(set(leftover()) - _BEFORE)


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail the test if it leaves a shmtrain segment in /dev/shm or a child process."""
    before = set(leftover())
    _BEFORE.clear()
    _BEFORE.update(before)
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
