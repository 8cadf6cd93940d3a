"""However a worker ends, what it started ends with it and the report says what happened:
a script's ``Popen`` children and forks are killed with the worker's process group, and
orphans a worker left with the zygote (its subreaper), on a normal end, a failure and
Ctrl-C, so ``shmtrain run ... | tail`` ends with the run; a user data set's error names
its file and line with loader processes and keeps its traceback in the rank's log; a rank
that calls ``sys.exit(0)`` mid-run is named as having left early (exit status 1, not an
undocumented 128); a Ctrl-C while the launcher exits prints no traceback; DataParallel
waits for peers as long as ``--timeout`` says."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from shmtrain.cli import main
from support.paths import ROOT, SUPPORT
from support.runs import wait_for

SPAWNER = """\
import os, subprocess, sys, time
here = os.path.dirname(os.path.abspath(__file__))
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])  # holds our stdout
fork = os.fork()
if fork == 0:
    time.sleep(300)
    os._exit(0)
with open(os.path.join(here, "pids-" + os.environ["RANK"]), "w") as f:
    f.write(f"{child.pid} {fork}")
if "--fail" in sys.argv:
    raise RuntimeError("on purpose")
if "--wait" in sys.argv:
    time.sleep(300)
"""

EXIT_EARLY = """\
import os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.ones(1)
for step in range(10000):
    dist.all_reduce(total)
    if step == 3 and dist.get_rank() == 1:
        sys.exit(0)
"""


def spawned(folder: Path, launcher: subprocess.Popen, ranks: int = 2) -> list[int]:
    wait_for(lambda: all((folder / f"pids-{r}").exists() for r in range(ranks)), launcher, "the children", 60)
    return [int(p) for r in range(ranks) for p in (folder / f"pids-{r}").read_text().split()]


def gone(pids: list[int], within: float = 10.0) -> bool:
    deadline, alive = time.monotonic() + within, pids
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.1)
    for pid in alive:  # not to leak them into other tests
        os.kill(pid, signal.SIGKILL)
    return False


def shmtrain_run(folder: Path, *args: str) -> subprocess.Popen:
    """``shmtrain run`` with its stdout a pipe, as ``shmtrain run ... | tail`` has it."""
    return subprocess.Popen([sys.executable, "-m", "shmtrain", "run", "--workers", "2", "--log-dir",
                             str(folder / "logs"), str(folder / "spawner.py"), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.mark.parametrize("how", ["end", pytest.param("fail", marks=pytest.mark.slow),
                                 pytest.param("ctrl-c", marks=pytest.mark.slow)])
def test_a_scripts_children_end_with_it_and_its_pipe_closes(tmp_path: Path, how: str) -> None:
    (tmp_path / "spawner.py").write_text(SPAWNER)
    launcher = shmtrain_run(tmp_path, *{"end": [], "fail": ["--fail"], "ctrl-c": ["--wait"]}[how])
    pids = spawned(tmp_path, launcher)
    if how == "ctrl-c":
        launcher.send_signal(signal.SIGINT)
    try:
        out, err = launcher.communicate(timeout=60)  # reads to EOF: a child holding stdout blocks it
    except subprocess.TimeoutExpired:
        launcher.kill()
        gone(pids, 0)
        raise AssertionError(f"{how}: the launcher's stdout stayed open (children of the script alive)") from None
    assert launcher.returncode == {"end": 0, "fail": 1, "ctrl-c": 130}[how], err
    assert gone(pids), f"{how}: children of the script outlived shmtrain run"


def test_a_train_workers_children_end_with_the_run(tmp_path: Path) -> None:
    code = main(["train", "--data", "support.data_sets:spawning", "--data-args", f"folder='{tmp_path}'",
                 "--model", "mlp",
                 "--workers", "2", "--batch-size", "4", "--iterations", "2", "--no-progress",
                 "--out", str(tmp_path / "run")])
    assert code == 0
    pids = [int((tmp_path / f"child-{r}").read_text()) for r in range(2)]
    assert gone(pids), "a child a worker's data set started outlived the run"


def test_a_data_sets_error_names_its_line_and_keeps_its_traceback(tmp_path: Path, capsys) -> None:
    code = main(["train", "--data", "support.data_sets:broken", "--model", "mlp", "--workers", "1",
                 "--batch-size", "4",
                 "--iterations", "2", "--loader-workers", "1", "--no-progress", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 1, err
    line = err.strip().splitlines()[-1]
    assert "KeyError" in line and "label_of_" in line, line
    source = SUPPORT / "data_sets.py"
    number = next(
        i for i, text in enumerate(source.read_text().splitlines(), 1) if "return torch.tensor([1.0, 2.0])" in text
    )
    assert f"{source}:{number}" in line, line  # the last frame, in the user's code
    log = (tmp_path / "run" / "logs" / "rank-0.log").read_text()
    assert "Traceback" in log and f'File "{source}", line {number}' in log, log[-3000:]


def test_a_rank_that_exits_0_mid_run_is_named_as_leaving_early(tmp_path: Path, capsys) -> None:
    (tmp_path / "early.py").write_text(EXIT_EARLY)
    code = main(["run", "--workers", "2", "--log-dir", str(tmp_path / "logs"), str(tmp_path / "early.py")])
    err = capsys.readouterr().err
    assert code == 1, err  # documented: a rank that left early; not 128 - 0
    assert "worker rank 1" in err and "left the job early" in err and "exit status 0" in err, err
    assert "worker rank 0 (pid" not in err, err  # the survivor is not blamed


def test_a_ctrl_c_while_the_zygote_closes_at_exit_prints_no_traceback() -> None:
    from shmtrain.runtime.launch import zygote

    seen: list[object] = []

    class Closing:
        class process:  # noqa: N801 - the part of Popen shutdown uses
            @staticmethod
            def kill() -> None:
                seen.append("killed")

        def close(self) -> None:
            seen.append(signal.getsignal(signal.SIGINT))
            raise KeyboardInterrupt  # the third Ctrl-C, typed while the launcher exits

    # a shell's background job starts with SIGINT ignored: give the test Python's own handler
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    real, zygote._ZYGOTE = zygote._ZYGOTE, Closing()  # type: ignore[assignment]
    try:
        zygote.shutdown()  # no KeyboardInterrupt out of an atexit handler
        assert seen == [signal.SIG_IGN, "killed"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    finally:
        zygote._ZYGOTE = real
        signal.signal(signal.SIGINT, before)


def test_dataparallel_waits_for_peers_as_long_as_the_timeout_says(monkeypatch) -> None:
    import torch

    import shmtrain
    from shmtrain.fabric.job import context

    asked: list[float] = []
    real = context.from_env

    def from_env(timeout: float = context.DEFAULT_TIMEOUT_S):
        asked.append(timeout)
        return real(timeout)

    monkeypatch.setattr(context, "from_env", from_env)
    monkeypatch.setenv("SHMTRAIN_TIMEOUT", "7.5")  # what shmtrain run --timeout 7.5 gives its workers
    model = torch.nn.Linear(2, 2)
    dp = shmtrain.DataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="single")
    dp.close()
    assert asked == [7.5]
