"""``shmtrain train`` through the command line: equivalence, the default job, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shmtrain.cli import main


def shmtrain(*args: str, timeout: float = 170) -> subprocess.CompletedProcess:
    env = dict(os.environ, SHMTRAIN_NO_PROGRESS="1")
    return subprocess.run([sys.executable, "-m", "shmtrain", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.slow  # ~23 s of CPU; ssgd equals one process in strategies/test_ssgd.py by default
def test_single_with_4b_equals_ssgd_with_4_workers_of_b(tmp_path: Path) -> None:
    common = ["--iterations", "12", "--seed", "7", "--lr", "0.05"]
    one = shmtrain("train", "--strategy", "single", "--workers", "1", "--batch-size", "32", *common,
                   "--out", str(tmp_path / "single"))
    assert one.returncode == 0, one.stderr
    four = shmtrain("train", "--strategy", "ssgd", "--workers", "4", "--batch-size", "8", *common,
                    "--out", str(tmp_path / "ssgd"))
    assert four.returncode == 0, four.stderr
    a = torch.load(tmp_path / "single" / "model.pt")
    b = torch.load(tmp_path / "ssgd" / "model.pt")
    for name in a:
        assert float((a[name] - b[name]).norm() / a[name].norm()) < 1e-5, name
    rows = (tmp_path / "ssgd" / "metrics" / "rank-3.jsonl").read_text().splitlines()
    assert len(rows) == 12
    row = json.loads(rows[-1])
    assert row["iteration"] == 12 and {"compute", "comm", "forward", "backward"} <= set(row["time"])


def test_default_job_reaches_90_percent_on_digits(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "shmtrain", "train", "--out", str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["strategy"] == "ssgd" and summary["workers"] == 4
    assert summary["accuracy"] >= 0.90
    assert summary["wall_s"] < 120
    assert "held-out accuracy" in result.stdout and "comm" in result.stdout
    for name in ("config.toml", "plot.png", "model.pt", "metrics/rank-0.jsonl", "metrics/rank-3.jsonl"):
        assert (tmp_path / "run" / name).is_file(), name
    assert 'strategy = "ssgd"' in (tmp_path / "run" / "config.toml").read_text()


def test_toml_config_and_flags_win(tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text('strategy = "single"\nworkers = 1\nbatch-size = 16\niterations = 3\nlr = 0.5\n')
    assert main(["train", "--config", str(cfg), "--lr", "0.01", "--out", str(tmp_path / "r"), "--no-progress"]) == 0
    resolved = (tmp_path / "r" / "config.toml").read_text()
    assert "lr = 0.01" in resolved and "batch-size = 16" in resolved
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["iterations"] == 3


@pytest.mark.parametrize(
    "args,words",
    [
        (["--workers", "0"], ["--workers", "0", "at least 1"]),
        (["--batch-size", "-2"], ["--batch-size", "-2", "positive"]),
        (["--lr", "0"], ["--lr", "0", "positive"]),
        (["--model", "nope"], ["--model", "nope", "smallcnn"]),
        (["--strategy", "nope"], ["--strategy", "nope", "ssgd"]),
        (["--data", "imagenet"], ["--data", "imagenet", "folder"]),
        (["--data", "/no/such/dir"], ["--data", "/no/such/dir", "folder"]),
        (["--iterations", "5", "--epochs", "1"], ["--iterations", "--epochs", "drop one"]),
        (["--strategy", "single", "--workers", "2"], ["--workers", "2", "one process"]),
        (["--device", "cuda:x"], ["--device", "cuda:x", "the GPU index must be a number", "--device cuda:0"]),
        (["--moving-rate", "0.5"], ["--moving-rate", "does not apply", "--strategy ssgd"]),
    ],
)
def test_bad_input_names_option_value_and_rule(args: list[str], words: list[str], capsys) -> None:
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, (word, err)


def test_unknown_toml_key_is_named(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("batchsize = 4\n")
    assert main(["train", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "batchsize" in err and "does not exist" in err and "batch-size" in err


def test_toml_value_of_the_wrong_type_is_named(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text('workers = "four"\n')
    assert main(["train", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"--config {cfg}: key 'workers' = 'four' must be an integer; e.g. workers = 4" in err


def test_bad_choice_of_a_strategy_option_is_an_argparse_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["train", "--allreduce", "bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--allreduce" in err and "bogus" in err and "shm" in err and "hierarchical" in err


def test_folder_of_images(tmp_path: Path) -> None:
    from PIL import Image

    for label, color in (("red", (255, 0, 0)), ("blue", (0, 0, 255))):
        folder = tmp_path / "imgs" / label
        folder.mkdir(parents=True)
        for i in range(12):
            shade = tuple(max(0, c - 8 * i) for c in color)
            Image.new("RGB", (10 + i, 12), shade).save(folder / f"{i}.png")
    assert main(["train", "--data", str(tmp_path / "imgs"), "--image-size", "8", "--workers", "2", "--batch-size",
                 "4", "--iterations", "20", "--lr", "0.05", "--out", str(tmp_path / "r"), "--no-progress"]) == 0
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["accuracy"] == 1.0  # red vs blue is easy


def test_each_commands_help_in_the_list_is_its_own() -> None:
    """``shmtrain --help`` lists every command by name and help without building its parser
    (no torch for ``train``'s flags): each of those helps is the one the command's whole parser
    was registered with."""
    from shmtrain.cli import COMMANDS, build_parser

    def listed(parser) -> dict[str, str]:
        sub = next(a for a in parser._actions if a.dest == "command")
        return {choice.dest: choice.help for choice in sub._choices_actions}

    assert listed(build_parser("")) == listed(build_parser()) == {name: text for name, (text, _) in COMMANDS.items()}


@pytest.mark.parametrize("words", [["--help"], ["--version"], ["compare", "--help"], ["sim", "--help"],
                                   ["smb-server", "--clients", "2", "--snapshot-every", "-1"]])
def test_commands_that_need_no_torch_do_not_wait_for_it(words: list[str]) -> None:
    """Only the command given is built whole: help, the version, or a bad option of a command
    that needs no torch to check it, answer without importing torch (seconds here)."""
    code = ("import sys\nfrom shmtrain.cli import main\ntry:\n    code = main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    code = e.code\nprint('torch' in sys.modules, code, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code, *words], capture_output=True, text=True, timeout=60)
    imported, status = done.stderr.split()[-2:]
    assert imported == "False", done.stderr
    assert status == ("2" if words[0] == "smb-server" else "0"), done.stderr
