"""Inputs checked to the last value: images of every PIL mode by their
own value range, finite float options, and JSON outputs that stay JSON when the
training diverges."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shmtrain.cli import main
from shmtrain.runtime.data.image_folder import load_image, open_image_folder
from shmtrain.runtime.data.images import image_to_tensor
from shmtrain.runtime.data.tensors import read_image
from shmtrain.runtime.train.finite import FLAG, json_text


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, as every other JSON parser does."""
    def refuse(word: str):
        raise ValueError(f"{word} is not JSON")

    return json.loads(text, parse_constant=refuse)


# -- images -------------------------------------------------------------------------------------
def test_a_16_bit_png_keeps_its_values(tmp_path: Path) -> None:
    values = (np.arange(16, dtype=np.uint16).reshape(4, 4) * 4369)  # 0 .. 65535
    Image.fromarray(values).save(tmp_path / "gray16.png")
    with Image.open(tmp_path / "gray16.png") as img:
        assert img.mode.startswith("I")
        tensor = image_to_tensor(img)
    assert tensor.shape == (3, 4, 4)
    expected = values.astype(np.float32) / 65535
    for channel in range(3):
        np.testing.assert_allclose(tensor[channel].numpy(), expected, atol=1e-6)
    resized = read_image(tmp_path / "gray16.png", 8)  # the loader's path, resized in float
    assert resized.shape == (8, 8, 3) and 0.0 <= resized.min() and resized.max() <= 1.0
    assert 0.3 < resized.mean() < 0.7  # not saturated to ones (8-bit conversion clipped it)


def test_a_palette_png_goes_through_its_palette(tmp_path: Path) -> None:
    img = Image.new("P", (2, 2))
    img.putpalette([0, 0, 0, 255, 0, 0, 0, 128, 255])
    img.putdata([0, 1, 2, 1])
    img.save(tmp_path / "palette.png")
    with Image.open(tmp_path / "palette.png") as loaded:
        assert loaded.mode == "P"
        tensor = image_to_tensor(loaded)
    np.testing.assert_allclose(tensor[:, 0, 1].numpy(), [1.0, 0.0, 0.0])  # index 1: red
    np.testing.assert_allclose(tensor[:, 1, 0].numpy(), [0.0, 128 / 255, 1.0])  # index 2
    np.testing.assert_allclose(tensor[:, 0, 0].numpy(), [0.0, 0.0, 0.0])


@pytest.mark.parametrize(("mode", "color", "rgb"), [
    ("CMYK", (0, 255, 0, 0), (1.0, 0.0, 1.0)),  # no cyan, full magenta: red + blue
    ("RGBA", (10, 20, 30, 0), (10 / 255, 20 / 255, 30 / 255)),  # alpha dropped
    ("LA", (51, 255), (0.2, 0.2, 0.2)),
    ("1", 1, (1.0, 1.0, 1.0)),
    ("I", 32768, (32768 / 65535,) * 3),
    ("F", 0.25, (0.25, 0.25, 0.25)),
])
def test_every_known_mode_keeps_its_range(mode: str, color, rgb) -> None:
    tensor = image_to_tensor(Image.new(mode, (3, 2), color))
    assert tensor.shape == (3, 2, 3)
    np.testing.assert_allclose(tensor[:, 0, 0].numpy(), rgb, atol=1e-6)


@pytest.mark.parametrize(("img", "words"), [
    (Image.new("LAB", (2, 2)), ["'LAB'", "cannot be converted", "save the image as RGB"]),
    (Image.new("I", (2, 2), 70000), ["'I'", "70000", "0..65535"]),
    (Image.new("F", (2, 2), 3.5), ["'F'", "3.5", "[0, 1]"]),
])
def test_a_mode_without_a_known_range_is_refused_by_name(img: Image.Image, words: list[str]) -> None:
    with pytest.raises(ValueError) as exc:
        image_to_tensor(img)
    for word in words:
        assert word in str(exc.value), str(exc.value)


def test_an_image_folder_of_16_bit_and_palette_images(tmp_path: Path) -> None:
    for index in range(3):
        (tmp_path / "a").mkdir(exist_ok=True)
        (tmp_path / "b").mkdir(exist_ok=True)
        Image.fromarray(np.full((4, 4), 30000 + index, dtype=np.uint16)).save(tmp_path / "a" / f"{index}.png")
        palette = Image.new("P", (4, 4), 1)
        palette.putpalette([0, 0, 0, 0, 255, 0])
        palette.save(tmp_path / "b" / f"{index}.png")
    train, val, classes, _ = open_image_folder(str(tmp_path), None, "3x4x4", "none", 0.2, False)
    assert classes == {"a": 0, "b": 1} and len(train) + len(val) == 6
    items = [train[i] for i in range(len(train))] + [val[i] for i in range(len(val))]
    x = np.stack([item[0].numpy() for item in items])
    y = np.array([item[1] for item in items])
    assert load_image(str(tmp_path / "a" / "0.png")).shape == (3, 4, 4)  # the loader: decoded lazily
    np.testing.assert_allclose(x[y == 0].mean(), 30001 / 65535, atol=1e-3)
    np.testing.assert_allclose(x[y == 1].mean(axis=(0, 2, 3)), [0.0, 1.0, 0.0], atol=1e-5)


# -- float options ------------------------------------------------------------------------------
@pytest.mark.parametrize(("flags", "named"), [
    (["--lr", "inf"], "--lr inf"),
    (["--weight-decay", "inf"], "--weight-decay inf"),
    (["--momentum", "nan"], "--momentum nan"),
    (["--strategy", "seasgd", "--moving-rate=-inf"], "--moving-rate -inf"),
])
def test_non_finite_float_options_are_refused(flags: list[str], named: str, tmp_path: Path, capsys) -> None:
    assert main(["train", *flags, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert named in err and "must be a finite number" in err and "use e.g." in err, err
    assert not (tmp_path / "run").exists()


def test_a_non_finite_toml_value_is_refused(tmp_path: Path, capsys) -> None:
    (tmp_path / "run.toml").write_text("lr = inf\n")
    assert main(["train", "--config", str(tmp_path / "run.toml"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"--config {tmp_path / 'run.toml'}" in err and "'lr' = inf" in err and "finite" in err, err


# -- JSON ---------------------------------------------------------------------------------------
def test_non_finite_values_are_written_as_null_with_a_flag() -> None:
    text = json_text({"loss": float("nan"), "lr": 0.1, "time": {"compute": float("inf"), "comm": 0.5}})
    row = strict_json(text)
    assert row["loss"] is None and row["time"]["compute"] is None and row["time"]["comm"] == 0.5
    assert row[FLAG] == {"loss": "nan", "time.compute": "inf"}
    assert FLAG not in strict_json(json_text({"loss": 1.0}))


@pytest.mark.timeout(120)
def test_a_diverging_run_names_the_iteration_and_leaves_valid_json(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    code = main(["train", "--strategy", "single", "--workers", "1", "--model", "mlp", "--data", "synthetic",
                 "--samples", "256", "--input-shape", "1x8x8", "--batch-size", "8", "--lr", "1e12",
                 "--momentum", "0", "--iterations", "200", "--no-progress", "--out", str(run)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "the training diverged" in err and "lower --lr (now 1e+12)" in err, err
    rows = [strict_json(line) for line in (run / "metrics" / "rank-0.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last["loss"] is None and last[FLAG]["loss"] in ("nan", "inf")
    assert f"at iteration {last['iteration']} is" in err, err
    assert all(r["loss"] is not None for r in rows[:-1])  # it stopped at the first one
    assert not (run / "summary.json").exists() and "Traceback" not in err
