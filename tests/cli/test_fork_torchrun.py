"""``shmtrain torchrun``: torchrun whose workers are forked from one process per host that
imported torch and shmtrain (start-up across hosts)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import at_once, new_segments
from support.torchrun import FORK, TORCHRUN, env, free_port

PROBE = """\
import json, os, signal, sys
import probe_helper  # a sibling module, found as `python probe.py` finds it
loaded = {m: m in sys.modules for m in ("torch", "torch._dynamo", "shmtrain.runtime.launch.worker",
"shmtrain.strategies")}
signals = [signal.getsignal(signal.SIGINT) is signal.default_int_handler,
           signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, signal.getsignal(signal.SIGHUP) == signal.SIG_DFL]
import pytest
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
out = sys.argv[1]
with open(f"{out}/rank{dist.get_rank()}.json", "w") as f:
    json.dump({"loaded": loaded, "sum": t.item(), "world": dist.get_world_size(), "argv": sys.argv[1:],
               "signals": signals, "main": __name__}, f)
rank = dist.get_rank()
dist.destroy_process_group()
sys.exit(int(os.environ.get("PROBE_EXIT", "0")) if rank == 1 else 0)
"""


def _hosts(launcher: list[str], head: list[str], args: list[str], out: Path) -> None:
    port = free_port()
    procs = [subprocess.Popen([*launcher, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
                               "--master-addr", "127.0.0.1", "--master-port", str(port), *head, *args,
                               "--out", str(out)], env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for node in range(2)]
    outputs = [p.communicate(timeout=170)[0].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs


@pytest.mark.slow  # ~55 s of CPU: two hosts twice; the fork start-up runs by default
def test_two_forked_hosts_train_as_two_torchrun_hosts(tmp_path: Path) -> None:
    """diloco across two hosts: the same weights from ``shmtrain torchrun`` as from torchrun."""
    args = ["--strategy", "diloco", "--sync-every", "4", "--iterations", "12", "--batch-size", "8", "--seed", "5",
            "--no-progress", "--checkpoint-every", "0"]
    _hosts(FORK, ["train"], args, tmp_path / "fork")
    _hosts(TORCHRUN, ["-m", "shmtrain", "train"], args, tmp_path / "torchrun")
    a, b = torch.load(tmp_path / "fork" / "model.pt"), torch.load(tmp_path / "torchrun" / "model.pt")
    for key in a:
        assert float((b[key] - a[key]).norm() / a[key].norm()) < 1e-6, key
    summary = json.loads((tmp_path / "fork" / "summary.json").read_text())
    assert summary["workers"] == 4 and summary["iterations"] == 12
    assert not new_segments(), new_segments()


def test_a_script_starts_with_torch_and_shmtrain_already_imported(tmp_path: Path) -> None:
    """The workers are forks of a process that imported what they need (a fresh
    interpreter under plain torchrun has none of it), with Python's signal defaults, not
    the agent's handlers; a script's arguments and exit status pass through."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    (tmp_path / "probe_helper.py").write_text("")
    cmd = ["--standalone", "--nproc-per-node", "2", str(script), str(tmp_path)]
    # rank 1 exits 3 once it has written what it saw: one launch shows both
    done = subprocess.run([*FORK, *cmd], env=dict(env(), PROBE_EXIT="3"), capture_output=True, text=True,
                          timeout=150)
    assert done.returncode == 1, done.stderr
    assert f"shmtrain torchrun: {script} failed on this host: rank 1 (exit status 3)" in done.stderr
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["loaded"] == {"torch": True, "torch._dynamo": True, "shmtrain.runtime.launch.worker": True,
                                 "shmtrain.strategies": True}, got
        assert got["sum"] == 3.0 and got["world"] == 2 and got["argv"] == [str(tmp_path)]
        assert got["signals"] == [True, True, True] and got["main"] == "__main__"  # as a fresh interpreter has them
    subprocess.run([*TORCHRUN, *cmd], env=env(), capture_output=True, timeout=150, check=True)
    assert not json.loads((tmp_path / "rank0.json").read_text())["loaded"]["torch._dynamo"]  # the contrast


def test_a_script_that_leaves_by_os_exit_ends_as_under_torchrun(tmp_path: Path) -> None:
    """``os._exit(0)`` (scripts use it to skip gloo's teardown) ends a forked worker as it
    ends a fresh one: torchrun's agent waited forever for the return value such a worker
    never sent; ``os._exit(3)`` is a failure naming the rank."""
    script = tmp_path / "leave.py"
    script.write_text("import os, sys\nos._exit(int(sys.argv[1]) if os.environ['RANK'] == '1' else 0)\n")
    out = at_once({code: ([*FORK, "--standalone", "--nproc-per-node", "2", str(script), str(code)], env())
                   for code in (0, 3)})
    assert out[0].returncode == 0, out[0].stderr
    assert out[3].returncode == 1 and "rank 1 (exit status 3)" in out[3].stderr, out[3].stderr


def test_what_cannot_be_forked_is_refused_with_the_fix(tmp_path: Path) -> None:
    for head, words in ((["-m", "shmtrain", "train"], "--module/-m cannot be used"),
                        (["--no-python", "train"], "--no-python cannot be used"),
                        ([str(tmp_path / "missing.py")], "is neither a shmtrain command")):
        done = subprocess.run([*FORK, "--standalone", "--nproc-per-node", "1", *head], env=env(),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and words in done.stderr, done.stderr
        assert "give `train ...`" in done.stderr


def test_ctrl_c_stops_the_workers_saves_and_leaves_nothing(tmp_path: Path) -> None:
    """SIGINT to the job's process group (a terminal's Ctrl-C): the workers save a
    checkpoint and stop, the launcher exits 130 with one line, no process or segment is left."""
    import os
    import signal
    import time

    out = tmp_path / "run"
    proc = subprocess.Popen([*FORK, "--standalone", "--nproc-per-node", "2", "train", "--iterations", "100000",
                             "--no-progress", "--checkpoint-every", "0", "--out", str(out)], env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 90
    while not list((out / "metrics").glob("rank-1.jsonl")) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # a few iterations in
    os.killpg(proc.pid, signal.SIGINT)
    text = proc.communicate(timeout=90)[0]
    assert proc.returncode == 130, text[-3000:]
    assert "shmtrain torchrun: stopped by SIGINT" in text and "saved" in text and "--resume" in text
    assert "Traceback" not in text, text[-3000:]
    assert list((out / "checkpoints").glob("step-*"))
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # the whole group is gone
    assert not new_segments(), new_segments()


def _limit_open_files(soft: int, hard: int):
    def limit() -> None:  # in the child only
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return limit


@pytest.mark.parametrize("launcher", ["fork", "torchrun"])
def test_an_open_file_limit_too_low_for_the_job_is_named_before_it_starts(tmp_path: Path, launcher: str) -> None:
    """``ulimit -n 32``: one line naming the limit and the fix (gloo's sockets failed far from
    it: "could not connect ... within 120 s"); a low soft limit under a high hard one is raised."""
    port = free_port()
    job = ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    argv = [*FORK, *job, "train"] if launcher == "fork" else [*TORCHRUN, *job, "-m", "shmtrain", "train"]
    argv += ["--iterations", "2", "--timeout", "20", "--no-progress", "--out", str(tmp_path / "run")]
    done = subprocess.run(argv, env=env(), capture_output=True, text=True, timeout=120,
                          preexec_fn=_limit_open_files(32, 32))
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if "open-file limit (ulimit -n) is 32 here" in line]
    assert lines and "needs about 272 open files per process" in lines[0] and "ulimit -n 4096" in lines[0], \
        done.stderr[-2000:]
    if launcher == "fork":
        assert done.returncode == 2 and "--nproc-per-node 2" in lines[0]
        raised = subprocess.run([*FORK, *job, "train", "--iterations", "2", "--timeout", "20", "--no-progress",
                                 "--out", str(tmp_path / "raised")], env=env(), capture_output=True, text=True,
                                timeout=120, preexec_fn=_limit_open_files(32, 4096))
        assert raised.returncode == 0, raised.stderr[-2000:]
