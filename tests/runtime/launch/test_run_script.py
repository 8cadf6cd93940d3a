"""``shmtrain run`` (``runtime/launch/script_launch.py``): one's own script on N local workers with
torchrun's environment; failures, SIGKILL and Ctrl-C; ``examples/ddp_script.py`` stopped
and resumed to the weights of a straight run, and the same script under torchrun."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from shmtrain.cli import main
from support.paths import ROOT
from support.runs import wait_for

EXAMPLE = ROOT / "examples" / "ddp_script.py"
#: the example's run: long enough to be interrupted after its first checkpoint (step 50)
STEPS = ["--steps", "600", "--ckpt-every", "50", "--log-every", "100", "--batch-size", "8", "--loader-workers", "1"]

PROBE = """\
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")  # env://, as under torchrun
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR"]
seen = {k: os.environ.get(k) for k in keys}
seen.update(argv=sys.argv, path0=sys.path[0], name=__name__, total=total.item())
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"seen-{dist.get_rank()}.json")
with open(out, "w") as f:
    json.dump(seen, f)
if "--fail" in sys.argv and dist.get_rank() == 1:
    raise RuntimeError("rank one gives up on purpose")
if "--loop" in sys.argv:  # collectives until a peer is gone
    open(out + ".ready", "w").close()
    while True:
        dist.all_reduce(total)
dist.destroy_process_group()
"""


def probe(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "probe.py").write_text(PROBE)
    return folder / "probe.py"


def run(*args: str) -> int:
    return main(["run", *args])


def start(args: list[str]) -> subprocess.Popen:
    """``shmtrain run`` in its own session, as a terminal runs it."""
    return subprocess.Popen([sys.executable, "-m", "shmtrain", "run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=ROOT)


def step_of(ckpt: Path) -> int:
    return torch.load(ckpt, weights_only=False)["step"]


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = torch.load(a, weights_only=False)["model"], torch.load(b, weights_only=False)["model"]
    assert wa.keys() == wb.keys()
    for key in wa:
        if wa[key].is_floating_point():
            assert float((wa[key] - wb[key]).norm() / wb[key].norm().clamp_min(1e-12)) < 1e-6, key


def test_the_script_gets_torchruns_environment_argv_and_path(tmp_path: Path) -> None:
    script = probe(tmp_path / "scripts")
    assert run("--workers", "2", "--log-dir", str(tmp_path / "logs"), str(script), "a", "--b") == 0
    for rank in range(2):
        seen = json.loads((tmp_path / "scripts" / f"seen-{rank}.json").read_text())
        assert seen["RANK"] == seen["LOCAL_RANK"] == seen["ROLE_RANK"] == str(rank)
        assert (seen["WORLD_SIZE"], seen["LOCAL_WORLD_SIZE"], seen["GROUP_RANK"]) == ("2", "2", "0")
        assert seen["MASTER_ADDR"] == "127.0.0.1" and seen["total"] == 3.0  # gloo through env://
        assert seen["argv"] == [str(script), "a", "--b"] and seen["name"] == "__main__"
        assert seen["path0"] == str(script.parent)
    assert "--- shmtrain run" in (tmp_path / "logs" / "rank-1.log").read_text()


def test_the_worker_target_is_the_function(tmp_path: Path, monkeypatch) -> None:
    """run_command hands the launcher run_script itself (as shmtrain train hands it
    train_worker); a fresh worker process imports it by the name derived from the function."""
    import shmtrain.runtime.launch.launcher as launcher
    import shmtrain.runtime.launch.script_launch as script_launch
    from shmtrain.runtime.launch.script_worker import run_script
    from shmtrain.runtime.launch.worker import resolve as resolve_target

    given: list = []
    monkeypatch.setattr(launcher, "launch", lambda target, workers, payload, **kw: given.append((target, payload)))
    script = probe(tmp_path / "scripts")
    assert script_launch.run_command([str(script), "a"], None, workers=2, log_dir=tmp_path / "logs") == 0
    assert not hasattr(script_launch, "TARGET")
    assert given == [(run_script, {"script": str(script), "module": None, "args": ["a"]})]
    assert resolve_target(launcher.target_name(run_script)) is run_script


def test_a_module_runs_as_python_m_runs_it(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    probe(package).rename(package / "train.py")
    (package / "__init__.py").write_text("")
    path = os.pathsep.join(str(Path(p).absolute()) for p in os.environ["PYTHONPATH"].split(os.pathsep) if p)
    done = subprocess.run([sys.executable, "-m", "shmtrain", "run", "--workers", "2", "--log-dir", "logs",
                           "-m", "pkg.train", "--x", "1"], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=path),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "logs" / "rank-1.log").exists()
    seen = json.loads((package / "seen-1.json").read_text())
    assert seen["argv"] == [str(package / "train.py"), "--x", "1"] and seen["name"] == "__main__"
    assert seen["path0"] == str(tmp_path)


def test_a_failing_rank_is_named_with_the_tail_of_its_log(tmp_path: Path, capsys) -> None:
    script = probe(tmp_path)
    assert run("--workers", "2", "--log-dir", str(tmp_path / "logs"), str(script), "--fail") == 1
    err = capsys.readouterr().err
    assert "worker rank 1" in err and "rank one gives up on purpose" in err, err
    assert "the last lines of worker rank 1's log (exit status 1)" in err and "| RuntimeError" in err, err
    assert str(tmp_path / "logs" / "rank-1.log") in err


def test_usage_errors_say_what_to_give(tmp_path: Path, capsys) -> None:
    assert run("--workers", "2") == 2
    assert "give the script to run" in capsys.readouterr().err
    assert run(str(tmp_path / "missing.py")) == 2
    assert "no such script" in capsys.readouterr().err
    for module, why in [("missing.module", "no module named 'missing' where python -m would look"),
                        ("json.nothere", "no module named 'json.nothere'"),
                        ("json", "'json' is a package without a __main__ module"),
                        ("json.tool.x", "'json.tool' is a module, not a package")]:
        assert run("--log-dir", str(tmp_path / "logs"), "-m", module) == 2, module
        assert why in capsys.readouterr().err, module
    assert not (tmp_path / "logs").exists()  # refused before any worker started
    with pytest.raises(SystemExit):
        run("--help")
    text = capsys.readouterr().out
    assert "shmtrain run --workers 2 examples/ddp_script.py" in text and "rank-<r>.log" in text


def test_sigkill_of_one_worker_stops_the_others(tmp_path: Path) -> None:
    script = probe(tmp_path)
    launcher = start(["--workers", "2", "--log-dir", str(tmp_path / "logs"), str(script), "--loop"])
    wait_for(lambda: all((tmp_path / f"seen-{r}.json.ready").exists() for r in range(2)), launcher, "start")
    workers = [p.pid for p in psutil.Process(launcher.pid).children(recursive=True) if p.name() == "shmtrain-w1"]
    others = [p.pid for p in psutil.Process(launcher.pid).children(recursive=True) if p.name() == "shmtrain-w0"]
    assert workers and others
    os.kill(workers[0], signal.SIGKILL)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 128 + signal.SIGKILL, err
    assert "worker rank 1" in err and "killed by SIGKILL" in err, err
    assert not [p for p in others if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> list[str]:
    """``--data DIR``: a generated image folder (examples/make_image_folder.py; 4 classes of
    60 images, 16x16), which the example reads as a DDP script does (ImageFolder,
    DistributedSampler, a DataLoader process per worker)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from make_image_folder import make
    finally:
        sys.path.remove(str(ROOT / "examples"))
    folder = tmp_path_factory.mktemp("shapes")
    make(folder, classes=4, per_class=60, size=16)
    return ["--data", str(folder / "train")]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, shapes: list[str]) -> Path:
    """The example's uninterrupted run on the image folder: its final checkpoint."""
    folder = tmp_path_factory.mktemp("straight")
    ckpt = folder / "ddp.pt"
    done = subprocess.run([sys.executable, "-m", "shmtrain", "run", "--workers", "2", "--log-dir", str(folder / "logs"),
                           str(EXAMPLE), *STEPS, *shapes, "--ckpt", str(ckpt)], capture_output=True, text=True,
                          timeout=150, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert step_of(ckpt) == 600 and "finished at step 600" in done.stdout
    return ckpt


@pytest.mark.slow  # ~100 s of CPU; runtime/checkpoint/test_checkpoint.py's Ctrl-C resume runs by default
def test_ctrl_c_saves_and_the_same_command_resumes_to_the_straight_runs_weights(straight: Path, shapes: list[str],
                                                                                 tmp_path: Path) -> None:
    ckpt = tmp_path / "ddp.pt"
    command = ["--workers", "2", "--log-dir", str(tmp_path / "logs"), str(EXAMPLE), *STEPS, *shapes, "--ckpt",
               str(ckpt), "--resume"]
    launcher = start(command)
    wait_for(ckpt.exists, launcher, "the first checkpoint")
    workers = [p.pid for p in psutil.Process(launcher.pid).children(recursive=True)]
    os.killpg(launcher.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 130, err
    assert "stopped by SIGINT" in err and "stopped by SIGINT after step" in out, (out, err)
    assert not [p for p in workers if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    stopped_at = step_of(ckpt)
    assert 50 <= stopped_at < 600
    again = subprocess.run([sys.executable, "-m", "shmtrain", "run", *command], capture_output=True, text=True,
                           timeout=150, cwd=ROOT)
    assert again.returncode == 0, again.stderr
    assert f"resumed from {ckpt} at step {stopped_at}" in again.stdout and step_of(ckpt) == 600
    assert_same_weights(ckpt, straight)
    assert (tmp_path / "logs" / "rank-0.log").read_text().count("--- shmtrain run") == 2  # both kept


@pytest.mark.slow  # ~35 s: an unchanged DDP script under torchrun runs by default in ddp/test_comm_hook.py
def test_the_same_script_runs_under_torchrun(straight: Path, shapes: list[str], tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ckpt = tmp_path / "ddp.pt"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(port), str(EXAMPLE), *STEPS,
                           *shapes, "--ckpt", str(ckpt)], capture_output=True, text=True, timeout=170, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert step_of(ckpt) == 600
    assert_same_weights(ckpt, straight)
