"""Batches of a :class:`~shmtrain.runtime.data.sources.DataSource`, sharded exactly
(ShmCaffe "DATA", swCaffe Section V-B "IO"; docs/data.md).

Every kind of data is cut into the same shards: :class:`ShardBatches` is a batch sampler
that yields, for global step ``t`` (from the run's position on, so a resumed run continues
mid-epoch), this worker's indices :meth:`ShardSampler.indices(t)
<shmtrain.runtime.data.tensors.ShardSampler.indices>`, so no sample is seen twice in an epoch
and the workers' batches of one step together are one process's batch of ``batch x
world``.

- Tensors in memory (digits, synthetic): :class:`~shmtrain.runtime.data.tensors.Prefetcher`, a
  thread slicing them.
- Anything else with ``--loader-workers N > 0``: a :class:`torch.utils.data.DataLoader`
  over that batch sampler, ``N`` processes forked (``fork``: from the training worker,
  itself forked from the zygote, ``runtime/launch/zygote.py``) that fetch and collate the
  shard's items, ``--prefetch`` batches ahead in all, pinned when the model is on a GPU.
  Each loader process ignores SIGINT (a terminal's Ctrl-C reaches the whole process
  group: the training worker finishes its iteration, saves and closes the loader) and
  dies with its training worker (``PR_SET_PDEATHSIG``: SIGKILL), so none outlives a
  killed worker; :meth:`LoaderBatches.close` ends them on every other exit path.
- ``--loader-workers 0``: the items are fetched in the training process, in its data
  phase.

Item ``i`` of epoch ``e`` is fetched with the torch generator seeded by (``--seed``, e,
i) (:func:`item_seed`): random transforms draw the same numbers with any ``N`` and after a
resume (the training process's own RNG is left untouched).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import re
import signal
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler
from torch.utils.data import Dataset as TorchDataset

from shmtrain.runtime.data.sources import DataSource
from shmtrain.runtime.data.tensors import Prefetcher, ShardSampler

#: samples per forward pass of the held-out evaluation
EVAL_BATCH = 256
_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15


def item_seed(seed: int, epoch: int, index: int) -> int:
    """The torch seed item ``index`` is fetched with in ``epoch`` of a run seeded ``seed``."""
    return ((seed * 1_000_003 + epoch) * 1_000_000_007 + index) % (1 << 63)


class ShardBatches(Sampler[list[tuple[int, int]]]):
    """A DataLoader batch sampler: this worker's ``(epoch, index)`` keys at every global
    step from ``start`` on (endless; the run stops taking batches)."""

    def __init__(self, sampler: ShardSampler, start: int = 0) -> None:
        self.sampler, self.start = sampler, start

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        step = self.start
        while True:
            epoch = step // self.sampler.steps_per_epoch
            yield [(epoch, int(i)) for i in self.sampler.indices(step)]
            step += 1


class SeededItems(TorchDataset):
    """``dataset[index]`` for a key ``(epoch, index)``, fetched under :func:`item_seed`."""

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        torch.manual_seed(item_seed(self.seed, epoch, index))
        return self.dataset[index]


def _loader_process_init(parent: int, worker_id: int) -> None:
    """In each DataLoader process: leave Ctrl-C and SIGTERM to the training worker, die
    with it, and be named ``shmtrain-data<i>`` (not the training worker's ``shmtrain-w<r>``,
    which the fork copied)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for signum in (signal.SIGTERM, signal.SIGHUP):  # not the training worker's stop handler
        signal.signal(signum, signal.SIG_DFL)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(f"shmtrain-data{worker_id}".encode()[:15]))
    except (OSError, AttributeError):  # not Linux: the DataLoader's own watchdog remains
        pass
    if os.getppid() != parent:  # the training worker died before the line above
        os._exit(1)


def _plain_error(exc: Exception) -> Exception:
    """A loader process's error as its last line, of the same type when it takes one
    message, with ``where`` (``file:line`` of every frame of the loader process's
    traceback, innermost last) for the launcher's line. Raised ``from`` the DataLoader's error, whose text
    holds that whole traceback: the worker's log keeps it."""
    text = str(exc)
    if "Original Traceback" not in text:
        return exc
    lines = [line for line in text.strip().splitlines() if line.strip()]
    last = lines[-1]
    message = last.split(": ", 1)[1] if ": " in last else last
    try:
        plain = type(exc)(message)
    except Exception:  # noqa: BLE001 - an exception type that takes other arguments
        plain = RuntimeError(message)
    frames = [re.match(r'\s*File "(.+)", line (\d+)', line) for line in lines]
    found = [f"{m.group(1)}:{m.group(2)}" for m in frames if m]
    if found:
        plain.where = found  # type: ignore[attr-defined]  # every frame, innermost last
    return plain


def _check_labels(batch: Any, classes: int, where: str) -> None:
    """An ``(x, y)`` batch with integer ``y``: every label is a class (or a token id of the
    vocabulary); other batches (real targets, dicts, token tensors) are the task's to read."""
    if not isinstance(batch, tuple | list) or len(batch) != 2 or not isinstance(batch[1], torch.Tensor):
        return
    y = batch[1]
    if y.is_floating_point() or y.dtype == torch.bool:
        return
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= classes):
        bad = int(y.min()) if int(y.min()) < 0 else int(y.max())
        raise ValueError(f"--data {where}: label {bad} is outside 0..{classes - 1} (the {classes} classes the "
                         "data set declares); fix the labels, or its classes/num_classes")


def _loader(dataset: Any, workers: int, pin: bool, prefetch: int, seed: int, **how: Any) -> DataLoader:
    extra: dict[str, Any] = {}
    if workers:
        extra = {"multiprocessing_context": "fork", "persistent_workers": True,
                 "prefetch_factor": max(1, math.ceil(prefetch / workers)),
                 "worker_init_fn": functools.partial(_loader_process_init, os.getpid())}
    return DataLoader(dataset, num_workers=workers, pin_memory=pin, generator=torch.Generator().manual_seed(seed),
                      **how, **extra)


def _shutdown(iterator: Any) -> None:
    """End a DataLoader iterator's processes and pin thread now (not at garbage collection)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


class LoaderBatches:
    """This worker's batches from DataLoader processes (or inline with 0 of them)."""

    def __init__(self, source: DataSource, sampler: ShardSampler, workers: int, pin: bool, prefetch: int,
                 seed: int, start: int = 0) -> None:
        self.source, self.workers = source, workers
        items = SeededItems(source.train, seed)
        self.loader = _loader(items, workers, pin, prefetch, seed, batch_sampler=ShardBatches(sampler, start))
        self._iter: Any = iter(self.loader)  # forks the loader processes (from this, the main thread)

    def next(self) -> Any:
        """The next step's batch (``(x, y)``, or what the items collate to)."""
        if self._iter is None:
            raise RuntimeError("the batches are closed")
        try:
            if self.workers:
                batch = next(self._iter)
            else:
                with torch.random.fork_rng(devices=[]):  # the item seeds leave the run's RNG alone
                    batch = next(self._iter)
        except StopIteration:  # pragma: no cover - the batch sampler is endless
            raise RuntimeError("the batch sampler ended") from None
        except Exception as exc:  # noqa: BLE001 - re-raised as its plain message
            plain = _plain_error(exc)
            if plain is exc:
                raise
            raise plain from exc
        _check_labels(batch, self.source.num_classes, self.source.name)
        return batch

    def close(self) -> None:
        """End the loader processes (idempotent)."""
        if self._iter is not None:
            _shutdown(self._iter)
            self._iter = None


def open_batches(source: DataSource, sampler: ShardSampler, config: Any, device: torch.device,
                 start: int = 0) -> Prefetcher | LoaderBatches:
    """This worker's batches from global step ``start``: a thread slicing tensors, or a
    DataLoader (module docstring)."""
    if source.tensors is not None:
        return Prefetcher(source.tensors.train_x, source.tensors.train_y, sampler, config.prefetch, start=start)
    return LoaderBatches(source, sampler, config.loader_workers or 0, device.type == "cuda", config.prefetch,
                         config.seed, start)


class Spread:
    """``count`` indices spread evenly over ``range(size)`` (``i * size // count``), computed
    per index: a bounded evaluation's subset of a huge held-out split in O(1) memory."""

    def __init__(self, size: int, count: int) -> None:
        self.size, self.count = size, min(count, size)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> int:
        if not -self.count <= i < self.count:
            raise IndexError(i)
        return (i % self.count) * self.size // self.count

    def indices(self) -> torch.Tensor:
        """Every index at once, as an int64 tensor (for slicing tensors in memory)."""
        return torch.arange(self.count, dtype=torch.int64) * self.size // self.count


class HeldOut:
    """Rank 0's held-out set in batches of :data:`EVAL_BATCH`: slices of tensors, or a
    DataLoader whose processes persist between evaluations (ended by :meth:`close`).
    ``limit`` (``--eval-samples``; 0: none) bounds the items an evaluation reads: a larger
    split is evaluated on :class:`Spread` of it, the same items every time, so an
    evaluation of a huge lazy data set's split ends in bounded time."""

    def __init__(self, source: DataSource, workers: int = 0, pin: bool = False, limit: int = 0) -> None:
        self.source = source
        self.loader: DataLoader | None = None
        total = source.val_samples
        #: the held-out items each evaluation reads (all of them, or ``limit`` spread over them)
        self.samples = min(total, limit) if limit else total
        self.spread = Spread(total, self.samples) if self.samples < total else None
        if source.tensors is None:
            val = source.val if self.spread is None else torch.utils.data.Subset(source.val, self.spread)
            self.loader = _loader(val, workers, pin, 2 * max(1, workers), 0, batch_size=EVAL_BATCH)

    def __len__(self) -> int:
        return self.samples

    def __iter__(self) -> Iterator[Any]:
        if self.loader is None:
            assert self.source.tensors is not None
            if self.spread is None:
                yield from self.source.tensors.held_out_batches(EVAL_BATCH)
                return
            index = self.spread.indices()
            x, y = self.source.tensors.test_x, self.source.tensors.test_y
            for start in range(0, self.samples, EVAL_BATCH):
                part = index[start : start + EVAL_BATCH]
                yield x[part], y[part]
            return
        try:
            for batch in self.loader:
                _check_labels(batch, self.source.num_classes, self.source.name)
                yield batch
        except Exception as exc:  # noqa: BLE001 - re-raised as its plain message
            plain = _plain_error(exc)
            if plain is exc:
                raise
            raise plain from exc

    def close(self) -> None:
        """End the persistent loader processes (idempotent)."""
        if self.loader is not None:
            _shutdown(getattr(self.loader, "_iterator", None))
            self.loader = None
