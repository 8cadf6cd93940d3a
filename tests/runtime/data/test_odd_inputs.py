"""Odd folders and mismatched models are refused before any worker starts (exit status 2,
one line naming the path or both sizes and the fix): a link to a folder inside a folder of
images (a loop would list every image again, under the wrong class), a folder whose
sub-folders are its splits (``train``/``val``) rather than its classes, and a model whose
output count is not the data's class count (too few or too many)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shmtrain.cli import main
from shmtrain.runtime.config import TrainConfig
from shmtrain.runtime.data.image_folder import open_image_folder
from shmtrain.runtime.launch import preflight
from support.images import image_folder


def refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as raised:
        raise SystemExit(main(["train", *argv]))
    err = capsys.readouterr().err
    assert raised.value.code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_a_link_loop_in_an_image_folder_is_refused_with_its_path(tmp_path: Path, capsys) -> None:
    root = image_folder(tmp_path / "train", classes=2, per_class=3)
    os.symlink("..", root / "class1" / "loop")  # ln -s .. train/class1/loop
    with pytest.raises(ValueError, match="loop"):
        open_image_folder(str(root), None, "3x8x8", "none", None, False)
    err = refused(["--data", str(root), "--out", str(tmp_path / "run")], capsys)
    assert str(root / "class1" / "loop") in err and "link to a folder" in err, err
    assert not (tmp_path / "run").exists()


def test_a_link_out_of_the_tree_is_refused_and_a_file_link_is_read(tmp_path: Path) -> None:
    root = image_folder(tmp_path / "data", classes=2, per_class=2)
    elsewhere = image_folder(tmp_path / "elsewhere", classes=1, per_class=2)
    os.symlink(root / "class0" / "0.png", root / "class1" / "linked.png")  # a file: read
    train, val, _, _ = open_image_folder(str(root), None, "3x8x8", "none", 0.2, False)
    assert len(train) + len(val) == 5
    os.symlink(elsewhere / "class0", root / "class2")  # a class folder that is a link: refused
    with pytest.raises(ValueError, match="class2"):
        preflight.check_data(TrainConfig(data=str(root), input_shape="3x8x8"))


@pytest.mark.parametrize("held", ["val", "test", "valid"])
def test_split_folders_are_refused_with_the_command_to_use(tmp_path: Path, capsys, held: str) -> None:
    root = tmp_path / "shapes"
    root.mkdir()
    image_folder(root / "train")
    image_folder(root / held)
    err = refused(["--data", str(root), "--out", str(tmp_path / "run")], capsys)
    assert f"--data {root}/train --val-data {root}/{held}" in err, err


@pytest.mark.parametrize(("outputs", "how"), [(3, "too few"), (12, "too many")])
def test_a_model_whose_outputs_are_not_the_class_count_is_refused(tmp_path: Path, capsys, outputs: int,
                                                                    how: str) -> None:
    config = TrainConfig(model="support.odd_models:fixed", model_args=f"outputs={outputs}", data="digits")
    with pytest.raises(ValueError, match=how):
        preflight.preflight(config, tmp_path / "run")
    err = refused(["--model", "support.odd_models:fixed", "--model-args", f"outputs={outputs}", "--force",
                   "--out", str(tmp_path / "run")], capsys)
    assert f"gives {outputs} outputs" in err and "10 classes" in err, err
