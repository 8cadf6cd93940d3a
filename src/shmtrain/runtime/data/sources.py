"""What a run trains on, whatever ``--data`` names (issue 30, item 1; docs/data.md).

:func:`open_data` gives a :class:`DataSource` for every kind of ``--data``, so the rest of
the run (sharding, checkpoints and resume, metrics, plots, compare) does not depend on
it:

- ``digits``, ``synthetic``: tensors in memory (``runtime/data/tensors.py``), batched by slicing
  in the prefetch thread;
- a folder of images: :func:`shmtrain.runtime.data.image_folder.open_image_folder`, decoded
  lazily by DataLoader workers;
- ``module:callable``: :mod:`shmtrain.runtime.data.user_data`, batched by DataLoader workers.

The launcher opens it too, before any worker starts (``runtime/launch/preflight.py``): the
checks fail there, in one line, and the run folder gets ``classes.json`` and the data's
facts (:func:`facts_comment`) in ``config.toml``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shmtrain.runtime.data.options import data_kind
from shmtrain.runtime.data.tensors import Dataset, load_data
from shmtrain.runtime.outputs.files import write_atomic

DIGIT_NAMES = [str(d) for d in range(10)]
#: the first words of the data's facts in ``config.toml`` (comments: not options)
FACTS_MARK = "# data (read from --data, not options):"


@dataclass
class DataSource:
    """One run's data: training and held-out sets of ``(x, label)`` items, and what the
    model and the run folder need to know of them."""

    name: str
    train: Any
    val: Any
    num_classes: int
    input_shape: tuple[int, ...]
    #: class name -> label (``RUN_DIR/classes.json``)
    classes: dict[str, int]
    #: files of a folder left out by ``--skip-bad-files``
    skipped: list[str] = field(default_factory=list)
    #: the same data as tensors, for digits and synthetic (batched by slicing, no loader workers)
    tensors: Dataset | None = None

    @property
    def train_samples(self) -> int:
        return len(self.train)

    @property
    def val_samples(self) -> int:
        return len(self.val)


def _from_tensors(data: Dataset, classes: dict[str, int]) -> DataSource:
    from torch.utils.data import TensorDataset

    return DataSource(data.name, TensorDataset(data.train_x, data.train_y), TensorDataset(data.test_x, data.test_y),
                      data.num_classes, data.input_shape, classes, tensors=data)


def open_data(config: Any) -> DataSource:
    """The :class:`DataSource` of ``config`` (a resolved ``TrainConfig``)."""
    kind = data_kind(config.data)
    if kind == "digits":
        return _from_tensors(load_data("digits", val_fraction=config.val_fraction), {name: i for i, name in enumerate(DIGIT_NAMES)})
    if kind == "synthetic":
        data = load_data("synthetic", input_shape=config.input_shape, samples=config.samples,
                         val_fraction=config.val_fraction)
        return _from_tensors(data, {str(i): i for i in range(data.num_classes)})
    if kind == "folder":
        from shmtrain.runtime.data.image_folder import open_image_folder

        train, val, classes, skipped = open_image_folder(config.data, config.val_data, config.input_shape,
                                                         config.transform, config.val_fraction, config.skip_bad_files)
        shape = tuple(int(d) for d in config.input_shape.lower().split("x"))
        return DataSource(Path(config.data).name, train, val, len(classes), shape, classes, skipped)
    return _open_user_data(config)


def _open_user_data(config: Any) -> DataSource:
    from shmtrain.runtime.data import user_data

    spec = config.data
    train, val = user_data.split_user_data(spec, user_data.call_data(spec, config.data_args), config.val_fraction)
    shape = user_data.check_item(spec, train[0], "training item 0")
    val_shape = user_data.check_item(spec, val[0], "validation item 0")
    if val_shape != shape:
        raise ValueError(f"--data {spec!r}: validation items have shape {val_shape}, training items {shape}; "
                         "give both the same shape")
    classes = user_data.class_map(spec, train)
    return DataSource(spec, train, val, max(classes.values()) + 1, shape, classes)


def facts_comment(source: DataSource) -> str:
    """The data's facts as TOML comments, for the end of ``config.toml``."""
    shape = "x".join(str(d) for d in source.input_shape)
    lines = [f"{FACTS_MARK} inputs {shape}, {source.num_classes} classes "
             "(classes.json),",
             f"# {source.train_samples} training samples, {source.val_samples} held out"]
    if source.skipped:
        lines[-1] += f", {len(source.skipped)} unreadable file(s) skipped"
    return "\n".join(lines) + "\n"


def write_run_facts(out: Path, source: DataSource) -> None:
    """``classes.json`` (class name -> label) and the facts at the end of ``config.toml``
    (rank 0, at every launch; facts already there are replaced)."""
    write_atomic(out / "classes.json", (json.dumps(source.classes, indent=1, ensure_ascii=False) + "\n").encode())
    toml = out / "config.toml"
    if toml.is_file():
        text = toml.read_text(encoding="utf-8")
        text = text.split(FACTS_MARK)[0] if FACTS_MARK in text else text
        write_atomic(toml, (text + facts_comment(source)).encode())
