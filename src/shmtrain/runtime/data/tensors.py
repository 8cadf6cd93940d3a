"""Training data: loaders, sharding without duplication (DATA), a prefetch thread (IO).

In-memory data sets: ``digits`` (scikit-learn's 8x8 handwritten digits, 1797 images,
shipped with the package) and ``synthetic`` (random tensors of a given shape whose labels
a model can learn), held as tensors, a share ``--val-fraction`` (0.2) held out for
accuracy. Folders of images and ``--data module:callable`` are opened lazily by
``runtime/data/sources.py`` and batched by DataLoader workers (``runtime/data/loader.py``), through
the same :class:`ShardSampler`.

Sharding (ShmCaffe, "DATA"): at every epoch a permutation seeded by ``seed + epoch``
is drawn, identically on every worker; global step ``t`` takes the slice
``[t*G, (t+1)*G)`` with ``G = batch * world``, and worker ``r`` takes its ``r``-th
``batch`` of it. No sample is seen twice in an epoch, and the union of the workers'
batches at step ``t`` is exactly the batch a single process with batch ``G`` sees.

Prefetch (swCaffe Section V-B, "IO"): a thread keeps ``depth`` batches ready (the
ShmCaffe paper uses 10); indexing releases the GIL, so it overlaps the training step.
"""

from __future__ import annotations

import functools
import math
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff", ".webp"}


@dataclass
class Dataset:
    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    #: images of a folder that could not be read and were skipped (``--skip-bad-files``)
    skipped: list[str] = field(default_factory=list)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train_x.shape[1:])

    @property
    def train_samples(self) -> int:
        return len(self.train_x)

    def held_out_batches(self, batch: int = 256) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The held-out split in batches of ``batch``."""
        for start in range(0, len(self.test_x), batch):
            yield self.test_x[start : start + batch], self.test_y[start : start + batch]


def parse_shape(text: str) -> tuple[int, ...]:
    """``"3x64x64"`` -> ``(3, 64, 64)``."""
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"--input-shape {text!r} must be CxHxW with positive integers, e.g. 3x64x64")
    return shape


def held_out(samples: int, fraction: float = 0.2) -> int:
    """Samples held out of ``samples`` (``--val-fraction``): ``floor(samples * fraction)``,
    at least 1."""
    return max(1, math.floor(samples * fraction + 1e-9))


def _split(x: torch.Tensor, y: torch.Tensor, seed: int, name: str, classes: int, fraction: float = 0.2) -> Dataset:
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    test = held_out(len(x), fraction)
    return Dataset(name, x[order[test:]], y[order[test:]], x[order[:test]], y[order[:test]], classes)


@functools.cache
def load_digits_data(fraction: float = 0.2) -> Dataset:
    """scikit-learn's digits (8x8, 10 classes), ``fraction`` held out (seed 0); read once
    per process (the zygote reads it before forking workers, so they share it)."""
    table = _digits_table()
    x = torch.from_numpy((table[:, :64] / 16.0).astype(np.float32)).view(-1, 1, 8, 8)
    y = torch.from_numpy(table[:, 64].astype(np.int64))
    return _split(x, y, 0, "digits", 10, fraction)


def _digits_table() -> np.ndarray:
    """The 1797 x 65 table (64 pixels, label) scikit-learn ships as ``digits.csv.gz``, read
    without importing scikit-learn (a second per process); its own loader otherwise."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return np.loadtxt(path, delimiter=",", dtype=np.float64)
    from sklearn.datasets import load_digits  # raises a clear ImportError when missing

    digits = load_digits()
    return np.concatenate([digits.data, digits.target[:, None]], axis=1)


def load_synthetic(shape: tuple[int, ...], samples: int, classes: int = 10, seed: int = 0,
                   fraction: float = 0.2) -> Dataset:
    """Gaussian inputs labelled by a fixed random linear map, so a model can learn them."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    x = torch.randn((samples, *shape), generator=gen)
    projection = torch.randn((int(np.prod(shape)), classes), generator=gen)
    y = (x.flatten(1) @ projection).argmax(1)
    return _split(x, y, seed, "synthetic", classes, fraction)


def read_image(file: Path, image_size: int) -> np.ndarray:
    """One image, RGB, resized to ``image_size`` squared, in [0, 1] by its mode's value
    range (16-bit, palette, CMYK, ...: ``runtime/data/images.py``); a ValueError naming the
    file when it cannot be decoded, or its mode has no known range."""
    from PIL import Image, UnidentifiedImageError

    from shmtrain.runtime.data.images import image_to_tensor

    try:
        with Image.open(file) as img:
            rgb = image_to_tensor(img, image_size)
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        raise ValueError(f"--data: image {str(file)!r} cannot be read ({exc.__class__.__name__}: "
                         f"{exc}); remove or replace the file, or pass --skip-bad-files") from None
    return rgb.permute(1, 2, 0).numpy()


#: training sets up to this size are shuffled with ``torch.randperm`` (8 bytes per sample per
#: worker, 8 MiB at most); larger ones with a permutation computed per index, in O(1) memory
#: (``runtime/data/permutation.py``), so neither memory nor start-up grows with the data set
EAGER_LIMIT = 1 << 20


class ShardSampler:
    """Indices of this worker's batch at every global step (see module docstring).

    The permutation of an epoch is ``torch.randperm`` for at most :data:`EAGER_LIMIT`
    samples (digits, synthetic and small data sets: the same batches as always), and
    :func:`~shmtrain.runtime.data.permutation.permute` beyond: only this step's ``batch``
    positions are mapped, whatever the size."""

    def __init__(self, size: int, batch: int, world: int, rank: int, seed: int) -> None:
        self.size, self.batch, self.world, self.rank, self.seed = size, batch, world, rank, seed
        self.global_batch = batch * world
        self.steps_per_epoch = size // self.global_batch
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"--batch-size {batch} x {world} workers = {self.global_batch} samples per step, "
                f"but the training set holds only {size}; use a smaller --batch-size"
            )
        self._epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    def indices(self, step: int) -> torch.Tensor:
        epoch, within = divmod(step, self.steps_per_epoch)
        start = within * self.global_batch + self.rank * self.batch
        if self.size > EAGER_LIMIT:
            from shmtrain.runtime.data.permutation import permute

            positions = np.arange(start, start + self.batch)
            return permute(positions, self.size, self.seed * 1_000_003 + epoch)
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.size, generator=gen)
            self._epoch = epoch
        return self._perm[start : start + self.batch]


class Prefetcher:
    """A thread that keeps ``depth`` batches ready, in step order, from step ``start``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, sampler: ShardSampler, depth: int = 10,
                 start: int = 0) -> None:
        self.x, self.y, self.sampler = x, y, sampler
        self.start = start  # the global step of the first batch (a resumed run's position)
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shmtrain-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        step = self.start
        while not self._stop.is_set():
            index = self.sampler.indices(step)
            item = (self.x.index_select(0, index), self.y.index_select(0, index))
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            step += 1

    def next(self, timeout: float = 60.0) -> tuple[torch.Tensor, torch.Tensor]:
        return self._queue.get(timeout=timeout)

    def close(self) -> None:
        """End the thread now: the batches it holds are dropped, so a ``put`` it waits in
        returns at once (a worker replaced in place closes its loader on the recovery's
        critical path)."""
        self._stop.set()
        deadline = time.monotonic() + 5.0
        while self._thread.is_alive() and time.monotonic() < deadline:
            try:
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.01)
