"""Checkpoint folders on disk: layout, atomic files with their CRC-32, validation, the
resume point, and whether a configuration may resume a checkpoint.

The layout and the write protocol are described in :mod:`shmtrain.runtime.checkpoint.checkpointer`,
whose :class:`~shmtrain.runtime.checkpoint.checkpointer.Checkpointer` (the worker side) writes and
reads through these functions; the launcher side (``shmtrain train --resume``,
``shmtrain runs``) uses them directly.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from shmtrain.runtime.config import COMMON_KEYS, TrainConfig, read_toml, resolve, to_toml
from shmtrain.runtime.files import replace_atomically, write_atomic

CHECKPOINTS = "checkpoints"
LATEST = "latest"
FORMAT = 1
_STEP = re.compile(r"^step-(\d+)$")

#: keys a resumed run may change: its length, and what does not touch the computation
MAY_CHANGE = frozenset({
    "iterations", "epochs", "out", "timeout", "progress", "verbose", "threads", "prefetch", "force",
    "checkpoint_every", "keep_checkpoints", "max_restarts",
    "eval_every", "tensorboard", "trace", "loader_workers", "keep_best", "early_stop",
})


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file."""


# -- files --------------------------------------------------------------------------------
def tensor_bytes(state: Any) -> int:
    """The bytes of every tensor in a nested state (about what ``torch.save`` writes)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, Mapping):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(tensor_bytes(v) for v in state)
    return 0


class _CrcWriter:
    """A file wrapper for ``torch.save`` that counts bytes and CRC-32 on the way out, and
    keeps the OSError of a failed write (torch's writer turns it into an anonymous
    "unexpected pos" RuntimeError; :func:`save_file` raises the OSError instead)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.crc, self.size = f, 0, 0
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(data)
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self.f.flush()


def save_file(state: Any, path: Path) -> tuple[int, int]:
    """``torch.save`` ``state`` to ``path`` atomically (``.part``, fsync, rename); returns
    ``(bytes, crc32)`` of what was written."""

    def fill(f: BinaryIO) -> tuple[int, int]:
        writer = _CrcWriter(f)
        try:
            torch.save(state, writer)  # type: ignore[arg-type] - a file-like object
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise
        return writer.size, writer.crc

    return replace_atomically(path, fill, tmp=path.with_name(path.name + ".part"))


def step_of(path: Path | str) -> int | None:
    """N of a complete checkpoint's folder name ``step-<N>``; None for any other name."""
    match = _STEP.match(Path(path).name)
    return int(match.group(1)) if match else None


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoint folders of ``run_dir``, oldest (fewest iterations) first."""
    folder = Path(run_dir) / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=lambda p: step_of(p) or 0)


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of ``run_dir`` (not validated; see :func:`resume_point`)."""
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def read_meta(path: Path) -> dict[str, Any]:
    """``meta.json`` of checkpoint ``path``; :class:`CheckpointError` naming it if unreadable."""
    file = Path(path) / "meta.json"
    try:
        meta = json.loads(file.read_bytes())
        if meta.get("format") != FORMAT or len(meta["ranks"]) != meta["world"]:
            raise ValueError(f"format {meta.get('format')!r}, {len(meta['ranks'])} of {meta['world']} ranks")
        for index, record in enumerate(meta["ranks"]):
            _check_record(index, record)
        return meta
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        reason = f"no key {exc}" if isinstance(exc, KeyError) else str(exc)
        raise CheckpointError(f"checkpoint file {file} is missing or damaged ({reason})") from None


def _check_record(index: int, record: Any) -> None:
    """A rank's record in ``meta.json``: rank, iteration, bytes and crc32, all integers."""
    if not isinstance(record, dict):
        raise ValueError(f"ranks[{index}] is {type(record).__name__}, not an object")
    for key in ("rank", "iteration", "bytes", "crc32"):
        if not isinstance(record.get(key), int) or isinstance(record.get(key), bool):
            what = "has no" if key not in record else f"has {record[key]!r} as its"
            raise ValueError(f"ranks[{index}] {what} {key!r} (an integer is needed)")
    if record["rank"] != index:
        raise ValueError(f"ranks[{index}] is the record of rank {record['rank']}")


def _check_bytes(file: Path, data: bytes, record: Mapping[str, Any]) -> None:
    if len(data) != record["bytes"] or zlib.crc32(data) != record["crc32"]:
        raise CheckpointError(
            f"checkpoint file {file} is corrupt or truncated: {len(data)} bytes with CRC-32 "
            f"{zlib.crc32(data):08x}, meta.json recorded {record['bytes']} bytes with CRC-32 "
            f"{record['crc32']:08x}"
        )


def validate(path: Path) -> dict[str, Any]:
    """Check that checkpoint ``path`` is whole: ``meta.json``, and every rank's file with
    the recorded size and CRC-32. Returns the meta; raises :class:`CheckpointError`."""
    meta = read_meta(path)
    for record in meta["ranks"]:
        file = Path(path) / f"rank-{record['rank']}.pt"
        try:
            data = file.read_bytes()
        except OSError as exc:
            raise CheckpointError(f"checkpoint file {file} cannot be read: {exc.strerror or exc}") from None
        _check_bytes(file, data, record)
    return meta


def load_rank(path: Path, rank: int, world: int) -> dict[str, Any]:
    """Rank ``rank``'s ``Trainer.state_dict()`` from checkpoint ``path`` (size and CRC-32
    checked first); :class:`CheckpointError` naming the file when it does not fit."""
    path = Path(path)
    meta = read_meta(path)
    if meta["world"] != world:
        raise CheckpointError(
            f"checkpoint {path} holds {meta['world']} ranks, this job has {world}: resume "
            f"with --workers {meta['world']} (under torchrun: {meta['world']} processes in all)"
        )
    file = path / f"rank-{rank}.pt"
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"checkpoint file {file} cannot be read: {exc.strerror or exc}") from None
    _check_bytes(file, data, meta["ranks"][rank])
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unpickling error: name the file
        raise CheckpointError(f"checkpoint file {file} cannot be loaded: {exc}") from None


def resume_point(run_dir: Path, warn: Callable[[str], None]) -> Path | None:
    """The newest complete and whole checkpoint of ``run_dir``, or None when it has none.

    A damaged one (``meta.json`` or a rank's file missing, truncated, or with another
    CRC-32) is named in a warning, moved aside to ``step-<N>.corrupt``, and the previous
    complete one is tried; ``latest`` is rewritten to the one returned.
    """
    for path in reversed(complete_checkpoints(run_dir)):
        try:
            validate(path)
        except CheckpointError as exc:
            aside = path.with_name(path.name + ".corrupt")
            shutil.rmtree(aside, ignore_errors=True)
            path.rename(aside)
            warn(f"shmtrain: warning: {exc}; moved {path.name} aside to {aside}, falling back to "
                 "the previous complete checkpoint")
            continue
        pointer = Path(run_dir) / CHECKPOINTS / LATEST
        try:  # bytes: a damaged pointer (any content) is rewritten, never decoded
            if not pointer.is_file() or pointer.read_bytes().strip() != path.name.encode():
                write_atomic(pointer, f"{path.name}\n".encode())
        except OSError as exc:
            raise CheckpointError(f"cannot write {pointer}: {exc.strerror or exc}; make the run "
                                  "folder writable, then run again") from None
        return path
    return None


def clean_partial(run_dir: Path) -> None:
    """Remove ``step-<N>.tmp`` folders (checkpoints a stopped or failed run left
    unfinished); call before any worker of a (re)start can write."""
    folder = Path(run_dir) / CHECKPOINTS
    if folder.is_dir():
        for path in folder.glob("step-*.tmp"):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


def prepare_run_folder(out: Path, config: TrainConfig) -> None:
    """Create the run folder and ``checkpoints/``, write ``config.toml`` atomically (the
    write is the check that the folder is writable), and clear unfinished checkpoints.

    Raises:
        ValueError: the folder cannot be written (names it; before any worker starts).
    """
    try:
        (out / CHECKPOINTS).mkdir(parents=True, exist_ok=True)
        write_atomic(out / "config.toml", to_toml(config).encode())
        clean_partial(out)
    except OSError as exc:
        where = exc.filename or out
        raise ValueError(
            f"--out {out}: the run folder cannot be written ({exc.strerror or exc}: {where}); "
            "checkpoints, metrics and the model go there: give a folder you can write, e.g. "
            "--out runs/my-run"
        ) from None


# -- configuration ------------------------------------------------------------------------
def _value(config: TrainConfig, key: str) -> Any:
    if hasattr(config, key) and key != "strategy_config":
        return getattr(config, key)
    return getattr(config.strategy_config, key, None)


def _show(key: str, value: Any) -> str:
    return f"{key.replace('_', '-')} = {value!r}"


def resume_config(run_dir: str, given: Mapping[str, Any]) -> TrainConfig:
    """The configuration of ``shmtrain train --resume RUN_DIR``: ``RUN_DIR/config.toml``,
    with the run length (``--iterations``/``--epochs``) and the keys of :data:`MAY_CHANGE`
    taken from ``given`` (the flags and ``--config`` values).

    Raises:
        ValueError: no run folder there, or a given value conflicts with the run's (names
            the key and both values), before any worker starts.
    """
    folder = Path(run_dir)
    toml = folder / "config.toml"
    if not folder.is_dir():
        raise ValueError(f"--resume {run_dir}: no such folder; give the run folder of an earlier "
                         "`shmtrain train` (its --out)")
    if not toml.is_file():
        raise ValueError(f"--resume {run_dir}: {toml} is missing, so this is not a run folder of "
                         "`shmtrain train`; give the folder an earlier run wrote (its --out)")
    saved_values = read_toml(str(toml))
    saved = resolve(saved_values)
    if "out" in given and given["out"] is not None and Path(given["out"]).resolve() != folder.resolve():
        raise ValueError(f"--resume {run_dir} --out {given['out']}: a resumed run continues in its own "
                         "folder; drop --out")
    for key, value in given.items():
        if key in MAY_CHANGE:
            continue
        before = _value(saved, key)
        if before != value:
            raise ValueError(
                f"--resume {run_dir}: --{key.replace('_', '-')} {value!r} conflicts with the run's "
                f"{_show(key, before)} ({toml}); a resumed run keeps its configuration and may "
                "change only its length (--iterations, --epochs) and --timeout, --no-progress, "
                "--threads, --checkpoint-every, --keep-checkpoints, --max-restarts; drop "
                f"--{key.replace('_', '-')}, or start a new run with another --out"
            )
    merged = dict(saved_values)
    if "iterations" in given or "epochs" in given:
        merged.pop("iterations", None)
        merged.pop("epochs", None)
    merged.update({k: v for k, v in given.items() if k in MAY_CHANGE})
    merged["out"] = str(folder)
    return resolve(merged)


def check_compatible(path: Path, config: TrainConfig) -> None:
    """Refuse to continue checkpoint ``path`` with a ``config`` that computes differently.

    Raises:
        ValueError: names the first key that differs, the checkpoint's value and this
            run's (everything but :data:`MAY_CHANGE` must be equal).
    """
    toml = Path(path) / "config.toml"
    try:
        saved = resolve(read_toml(str(toml)))
    except ValueError as exc:
        raise ValueError(f"checkpoint {path}: its config.toml cannot be read ({exc})") from None
    options = sorted((set(saved.to_dict()) | set(config.to_dict())) - set(COMMON_KEYS))
    for key in [*COMMON_KEYS, *options]:  # the strategy first, then its options
        if key in MAY_CHANGE:
            continue
        if _value(saved, key) != _value(config, key):
            raise ValueError(
                f"checkpoint {path} was written with {_show(key, _value(saved, key))}, this run has "
                f"{_show(key, _value(config, key))}: a run continues only with the configuration "
                f"it was saved with; use {_show(key, _value(saved, key))}, or start a new run "
                "with another --out"
            )
