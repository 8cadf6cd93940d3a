"""Bad input is refused before any worker starts: exit status 2, one line naming the
option (no traceback), no run folder left behind, in seconds (the launcher's checks in
``runtime/config.py`` and ``runtime/launch/preflight.py``)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from shmtrain.cli import main
from support.images import image_folder


def toml(tmp: Path, text: str) -> str:
    path = tmp / "run.toml"
    path.write_text(text)
    return str(path)


# (arguments, words the one-line error must contain); {tmp} is the test's folder
CATALOGUE: list[tuple[list[str], list[str]]] = [
    (["--workers", "0"], ["--workers", "0"]),
    (["--workers", "10000"], ["--workers", "10000", "--force"]),
    (["--batch-size", "0"], ["--batch-size"]),
    (["--batch-size", "5000"], ["--batch-size", "5000", "holds"]),
    (["--lr", "-1"], ["--lr"]),
    (["--momentum", "1.5"], ["--momentum"]),
    (["--weight-decay", "-1"], ["--weight-decay"]),
    (["--threads", "0"], ["--threads"]),
    (["--timeout", "0"], ["--timeout"]),
    (["--iterations", "0"], ["--iterations"]),
    (["--epochs", "0"], ["--epochs"]),
    (["--iterations", "5", "--epochs", "1"], ["--iterations", "--epochs"]),
    (["--prefetch", "0"], ["--prefetch"]),
    (["--image-size", "0"], ["--image-size"]),
    (["--model", "nonesuch"], ["--model", "nonesuch"]),
    (["--data", "{tmp}/nowhere"], ["--data", "nowhere"]),
    (["--data", "synthetic", "--input-shape", "3x0x4"], ["--input-shape", "3x0x4"]),
    (["--data", "synthetic", "--input-shape", "abc"], ["--input-shape", "abc"]),
    (["--data", "synthetic", "--samples", "1"], ["--samples"]),
    (["--strategy", "bogus"], ["--strategy", "bogus"]),
    (["--strategy", "single", "--workers", "2"], ["--workers", "single"]),
    (["--out", "{tmp}/afile"], ["--out", "afile", "file"]),
    (["--device", "cuda"], ["--device", "cuda"]),
    (["--strategy", "seasgd", "--moving-rate", "2"], ["--moving-rate"]),
    (["--strategy", "seasgd", "--update-interval", "0"], ["--update-interval"]),
    (["--strategy", "hsgd", "--groups", "3"], ["--groups"]),
    (["--strategy", "ssgd", "--moving-rate", "0.2"], ["--moving-rate", "ssgd"]),
    (["--bucket-mb", "0"], ["--bucket-mb"]),
    (["--data", "{tmp}/oneclass"], ["--data", "sub-folder"]),
    (["--data", "{tmp}/badimage"], ["--data", "0.png"]),
    (["--data", "{tmp}/emptyclass"], ["--data", "empty"]),
    (["--data", "{tmp}/tiny", "--batch-size", "8"], ["--batch-size", "8"]),
    (["--config", "{tmp}/missing.toml"], ["--config", "missing.toml"]),
    (["--config", "toml:workers = \"four\""], ["workers", "four"]),
    (["--config", "toml:lr = \"fast\""], ["lr", "fast"]),
    (["--config", "toml:bogus-key = 1"], ["bogus-key"]),
    (["--config", "toml:progress = 3"], ["progress", "3"]),
    (["--config", "toml:workers = ["], ["--config", "TOML"]),
    (["--config", "toml:model = \"resnet50\"\ndata = \"synthetic\"\ninput-shape = \"3x224x224\"\n"
      "samples = 100000\nbatch-size = 4096\nworkers = 2"], ["memory", "--batch-size", "--force"]),
]


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("I am a file\n")
    image_folder(tmp_path / "oneclass", classes=1)
    image_folder(tmp_path / "badimage", bad=True)
    image_folder(tmp_path / "emptyclass", empty_class=True)
    image_folder(tmp_path / "tiny", classes=2, per_class=2)
    return tmp_path


def test_catalogue_has_thirty_cases():
    assert len(CATALOGUE) >= 30


@pytest.mark.parametrize(("args", "words"), CATALOGUE, ids=[" ".join(a)[:40] for a, _ in CATALOGUE])
def test_bad_input_is_one_clear_line(workspace: Path, capsys, args: list[str], words: list[str]) -> None:
    argv = []
    for arg in args:
        if arg.startswith("toml:"):
            arg = toml(workspace, arg.removeprefix("toml:"))
        argv.append(arg.replace("{tmp}", str(workspace)))
    before = set(workspace.iterdir())
    start = time.monotonic()
    with pytest.raises(SystemExit) as raised:
        raise SystemExit(main(["train", *argv]))
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert raised.value.code == 2, err
    assert "Traceback" not in err
    for word in words:
        assert word in err, (word, err)
    created = set(workspace.iterdir()) - before - {workspace / "run.toml"}
    assert not created, f"left behind: {created}"
    assert elapsed < 20, elapsed


def _fake_cgroup_v2(root: Path, monkeypatch, limit: int, used: int) -> Path:
    """A cgroup v2 tree under ``root`` whose leaf (this process's) is under a parent with
    ``limit``, ``used`` bytes in use."""
    from shmtrain.runtime.launch import preflight

    leaf = root / "job.slice" / "run"
    leaf.mkdir(parents=True)
    (root / "job.slice" / "memory.max").write_text(f"{limit}\n")
    (leaf / "memory.max").write_text("max\n")
    (leaf / "memory.current").write_text(f"{used}\n")
    proc = root / "self-cgroup"
    proc.write_text("0::/job.slice/run\n")
    monkeypatch.setattr(preflight, "CGROUP_ROOT", root)
    monkeypatch.setattr(preflight, "PROC_CGROUP", proc)
    return root / "job.slice" / "memory.max"


def test_a_cgroup_memory_limit_below_what_the_run_needs_is_refused_naming_it(workspace: Path, capsys,
                                                                            monkeypatch) -> None:
    limit = _fake_cgroup_v2(workspace / "cgroup", monkeypatch, limit=int(1.2 * (1 << 30)), used=300 << 20)
    argv = ["--model", "resnet18", "--data", "synthetic", "--input-shape", "3x64x64", "--samples", "2000",
            "--batch-size", "256", "--workers", "2", "--out", str(workspace / "run")]
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert "cgroup memory limit (1.2 GiB in " + str(limit) in err and "300.0 MiB in use" in err, err
    assert "--force" in err and "--batch-size" in err


def test_a_tiny_dev_shm_is_named_with_real_sizes(monkeypatch) -> None:
    from shmtrain.runtime.config import TrainConfig
    from shmtrain.runtime.launch import preflight

    config = TrainConfig(model="mlp", data="digits", workers=2)
    facts = preflight.check_data(config)
    monkeypatch.setattr(preflight, "available_bytes", lambda: (64 << 30, 1 << 20, "available"))
    with pytest.raises(ValueError) as refused:
        preflight.check_memory(config, facts, 2, preflight.ModelProbe(4 << 20, 0, 10))
    assert "the shared buffers need about 16.0 MiB in /dev/shm but 1.0 MiB is free there" in str(refused.value)
