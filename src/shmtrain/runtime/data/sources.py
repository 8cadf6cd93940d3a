"""What a run trains on, whatever ``--data`` names (docs/data.md).

:func:`open_data` gives a :class:`DataSource` for every kind of ``--data`` (each kind's
``Config.build``, :mod:`shmtrain.runtime.data.kinds`), so the rest of the run (sharding,
checkpoints and resume, metrics, plots, compare) does not depend on it:

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

from shmtrain.runtime.data.tensors import Dataset
from shmtrain.runtime.files import write_atomic

#: the first words of the data's facts in ``config.toml`` (comments: not options)
FACTS_MARK = "# data (read from --data, not options):"


@dataclass(frozen=True)
class DataFacts:
    """What the launcher knows about the data without loading it."""

    train_samples: int
    input_shape: tuple[int, ...]
    num_classes: int
    #: the samples live in each worker's memory (digits, synthetic), not decoded per batch
    in_memory: bool = True
    #: one forward pass of a model on two real items (a task's data, runtime/tasks/data.py)
    probe: Any = None
    #: what opening the data cost the launcher (its resident memory before and after): every
    #: worker opens it too (a folder's file list, what a user's data set holds)
    open_bytes: int = 0


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

    def facts(self) -> DataFacts:
        """What the launcher checks against the options (size, shape, classes)."""
        return DataFacts(self.train_samples, self.input_shape, self.num_classes,
                         in_memory=self.tensors is not None)


def resident_bytes() -> int:
    """This process's resident memory (``/proc/self/statm``), 0 where it cannot be read."""
    import os

    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def from_tensors(data: Dataset, classes: dict[str, int]) -> DataSource:
    """A :class:`DataSource` of tensors in memory (batched by slicing, no loader processes)."""
    from torch.utils.data import TensorDataset

    return DataSource(data.name, TensorDataset(data.train_x, data.train_y), TensorDataset(data.test_x, data.test_y),
                      data.num_classes, data.input_shape, classes, tensors=data)


def open_data(config: Any) -> DataSource:
    """The :class:`DataSource` of ``config`` (a resolved ``TrainConfig``): its data kind's
    ``Config`` builds it (:mod:`shmtrain.runtime.data.kinds`)."""
    return config.data_config.build()


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
