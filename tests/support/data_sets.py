"""Data sets for ``--data support.data_sets:<name>`` in tests/runtime/data/test_data.py and
the other data tests (the tests folder is on PYTHONPATH, so the workers import them too)."""

from __future__ import annotations

import os

import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset


def _blobs(samples: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Class c: gaussian noise around the mean c (learnable by a linear model)."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(samples) % classes
    x = torch.randn((samples, 1, 4, 4), generator=gen) * 0.3 + y.view(-1, 1, 1, 1).float()
    return x, y


def blobs(samples: int = 96, classes: int = 3, seed: int = 0) -> TensorDataset:
    """One Dataset (the run holds out --val-fraction of it); classes from a scan."""
    return TensorDataset(*_blobs(samples, classes, seed))


def named_pair(samples: int = 96) -> tuple[Dataset, Dataset]:
    """A (train, val) pair whose training set names its classes."""
    train = TensorDataset(*_blobs(samples, 3, 0))
    train.classes = ["low", "mid", "high"]  # type: ignore[attr-defined]
    return train, TensorDataset(*_blobs(24, 3, 1))


class Indexed(Dataset):
    """Item i is (x, label) with x holding i and a random number drawn while fetching
    (what a random transform does), label i mod 4; ``num_classes`` declared."""

    num_classes = 4

    def __init__(self, size: int = 40) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.tensor([float(index), float(torch.rand(()))]), index % 4


def not_a_dataset() -> int:
    """Not a data set at all: an int (refused by name)."""
    return 42


class _Items(Dataset):
    def __init__(self, item) -> None:
        self.item = item

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int):
        return self.item


def no_pairs() -> Dataset:
    """Items that are bare tensors, not (input, label) pairs (refused)."""
    return _Items(torch.zeros(3))


def int_inputs() -> Dataset:
    """Integer inputs, which a model cannot take as they are (refused)."""
    return _Items((torch.zeros(3, dtype=torch.long), 0))


def float_labels() -> Dataset:
    """A label of 0.5, not a class index (refused)."""
    return _Items((torch.zeros(3), 0.5))


class _Stream(IterableDataset):
    def __iter__(self):
        yield torch.zeros(3), 0


def stream() -> IterableDataset:
    """An IterableDataset: no length, no index (refused: a map-style set is needed)."""
    return _Stream()


def wrong_classes() -> Dataset:
    """Declares 2 classes, holds labels up to 3: refused when a batch holds one."""
    data = blobs(64, 4)
    data.num_classes = 2  # type: ignore[attr-defined]
    return data


class Huge(Dataset):
    """``size`` lazy items (10^9 by default), nothing held per item; two classes declared."""

    num_classes = 2

    def __init__(self, size: int = 10**9) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.tensor([float(index % 7), 1.0]), index % 2


class Heavy(Huge):
    """A data set that holds ``mb`` MB once opened (what loading a table would)."""

    def __init__(self, mb: int = 64) -> None:
        super().__init__(1000)
        self.table = torch.ones(mb * 1 << 20, dtype=torch.uint8)  # touched: resident


def huge(size: int = 10**9) -> Huge:
    """:class:`Huge` of ``size`` items."""
    return Huge(size)


def heavy(mb: int = 64) -> Heavy:
    """:class:`Heavy` holding ``mb`` MB."""
    return Heavy(mb)


class Broken(Huge):
    """Fails in a worker (``RANK`` set; the launcher's checks read items too) on item 37's
    lookup, as a data set with a missing label does."""

    def __init__(self) -> None:
        super().__init__(64)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        labels = {} if "RANK" in os.environ else {f"label_of_{index}": index % 2}
        return torch.tensor([1.0, 2.0]), labels[f"label_of_{index}"]


def broken() -> Broken:
    """:class:`Broken`, whose item 37 fails in a worker."""
    return Broken()


class Spawning(Huge):
    """Starts a child process in each worker that opens it (``RANK`` set), as a data set
    with a helper server would, and writes its pid to ``folder``/child-<rank>."""

    def __init__(self, folder: str) -> None:
        super().__init__(64)
        if "RANK" in os.environ:
            import subprocess
            import sys

            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
            with open(os.path.join(folder, f"child-{os.environ['RANK']}"), "w") as f:
                f.write(str(child.pid))


def spawning(folder: str) -> Spawning:
    """:class:`Spawning`, whose workers each start a child process."""
    return Spawning(folder)
