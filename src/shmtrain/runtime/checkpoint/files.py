"""Checkpoint folders on disk: layout, atomic files with their CRC-32, validation, the
resume point, and whether a configuration may resume a checkpoint.

A checkpoint holds tensors, numbers, strings, lists, tuples and dicts only (checked when
it is written, :func:`check_plain`) and is loaded with ``torch.load(weights_only=True)``,
which rebuilds those and nothing else: loading one never runs code it names. Its files
are read only when they are trusted (:mod:`shmtrain.runtime.trusted_files`). A
checkpoint of an earlier shmtrain (``meta.json`` format 1, whose files hold numpy's RNG
state as pickled numpy objects) is refused by name, never unpickled.

The layout and the write protocol are described in :mod:`shmtrain.runtime.checkpoint.checkpointer`,
whose :class:`~shmtrain.runtime.checkpoint.checkpointer.Checkpointer` (the worker side) writes and
reads through these functions; the launcher side (``shmtrain train --resume``,
``shmtrain runs``) uses them directly.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import shutil
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from shmtrain.fabric.trust import UntrustedError
from shmtrain.runtime import trusted_files
from shmtrain.runtime.config import COMMON_KEYS, TrainConfig, read_toml, resolve, to_toml
from shmtrain.runtime.files import replace_atomically, write_atomic

CHECKPOINTS = "checkpoints"
LATEST = "latest"
#: 2: every file loads with torch.load(weights_only=True); 1: files of an earlier shmtrain
FORMAT = 2
#: the formats whose meta.json is read (a format-1 checkpoint is then refused by name)
READ_FORMATS = (1, 2)
#: what a checkpoint may hold besides tensors and containers (what weights_only rebuilds)
PLAIN = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, torch.Size)
_STEP = re.compile(r"^step-(\d+)$")

#: keys a resumed run may change: its length, and what does not touch the computation
MAY_CHANGE = frozenset({
    "iterations", "epochs", "out", "timeout", "progress", "verbose", "threads", "prefetch", "force",
    "checkpoint_every", "keep_checkpoints", "max_restarts",
    "eval_every", "eval_samples", "tensorboard", "trace", "loader_workers", "keep_best", "early_stop",
})


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file."""


class RefusedCheckpoint(CheckpointError):
    """A whole checkpoint that is not loaded: of an earlier format, or holding objects that
    only unpickling rebuilds (it is not moved aside as damaged; the message says what to do)."""


def check_plain(state: Any, where: str = "state") -> None:
    """Raise :class:`CheckpointError` unless ``state`` holds only tensors, numbers,
    strings, None, lists, tuples, sets and dicts of them (what ``weights_only`` loads),
    naming the first value that is something else (a walk over the keys, not the data)."""
    if isinstance(state, (torch.Tensor, *PLAIN)):
        return
    if isinstance(state, Mapping) and type(state) in (dict, OrderedDict):
        for key, value in state.items():
            if not isinstance(key, str | int | float | bool | type(None) | tuple):
                raise CheckpointError(f"cannot save {where}: a key is a {type(key).__name__}")
            check_plain(value, f"{where}[{key!r}]")
        return
    if type(state) in (list, tuple, set):
        for index, value in enumerate(state):
            check_plain(value, f"{where}[{index}]")
        return
    raise CheckpointError(
        f"cannot save {where}: it is a {type(state).__module__}.{type(state).__qualname__}; a checkpoint holds "
        "tensors, numbers, strings, lists, tuples and dicts only (it is loaded with torch.load(weights_only=True), "
        "which rebuilds nothing else): return those from state_dict() and convert them back in load_state_dict()")


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
    ``(bytes, crc32)`` of what was written. :class:`CheckpointError` before anything is
    written when ``state`` holds what a checkpoint may not (:func:`check_plain`)."""
    check_plain(state)

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
        meta = json.loads(trusted_files.read_bytes(file, "checkpoint file"))
        if meta.get("format") not in READ_FORMATS or len(meta["ranks"]) != meta["world"]:
            raise ValueError(f"format {meta.get('format')!r}, {len(meta['ranks'])} of {meta['world']} ranks")
        for index, record in enumerate(meta["ranks"]):
            _check_record(index, record)
        return meta
    except UntrustedError:
        raise
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


def _read_rank(file: Path) -> bytes:
    """A rank's file, read after the trust check (:mod:`shmtrain.runtime.trusted_files`)."""
    try:
        return trusted_files.read_bytes(file, "checkpoint file")
    except OSError as exc:
        raise CheckpointError(f"checkpoint file {file} cannot be read: {exc.strerror or exc}") from None


def _check_format(path: Path, meta: Mapping[str, Any]) -> None:
    if meta["format"] != FORMAT:
        raise RefusedCheckpoint(
            f"checkpoint {path} was written by an earlier shmtrain (meta.json format {meta['format']}): its files "
            "hold numpy's RNG state as pickled numpy objects, which only unpickling rebuilds, and unpickling runs "
            "whatever code a file names, so this shmtrain does not load it; start a new run (another --out), or "
            "finish this one with the shmtrain version that wrote it")


def _refuse_unpickling(file: Path, data: bytes, reason: str = "") -> RefusedCheckpoint:
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception:  # noqa: BLE001 - only for the message: the reason is given instead
        names = []
    what = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "") if names else reason
    return RefusedCheckpoint(
        f"checkpoint file {file} cannot be loaded with torch.load(weights_only=True): it holds Python objects "
        f"({what}) that only unpickling rebuilds, and unpickling runs the code a file names, so it is refused; "
        f"shmtrain writes no such objects, so something else made or altered the file: resume from an earlier "
        f"checkpoint (remove {file.parent}) or start a new run")


def _check_loadable(file: Path, data: bytes) -> None:
    """Refuse a rank's file that ``weights_only`` would not load (it names other objects
    than tensors and containers): a scan of its pickle, not a load of its tensors."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception as exc:  # noqa: BLE001 - not a torch.save file at all
        raise CheckpointError(f"checkpoint file {file} cannot be loaded: {exc}") from None
    if names:
        raise _refuse_unpickling(file, data)


def validate(path: Path) -> dict[str, Any]:
    """Check that checkpoint ``path`` is whole: ``meta.json``, and every rank's file with
    the recorded size and CRC-32. Returns the meta; raises :class:`CheckpointError`
    (:class:`RefusedCheckpoint` for a whole one that is not loaded: an earlier format, or
    a file that names objects other than tensors and containers)."""
    meta = read_meta(path)
    files = {}
    for record in meta["ranks"]:
        file = Path(path) / f"rank-{record['rank']}.pt"
        files[file] = _read_rank(file)
        _check_bytes(file, files[file], record)
    _check_format(Path(path), meta)
    for file, data in files.items():
        _check_loadable(file, data)
    return meta


def load_rank(path: Path, rank: int, world: int) -> dict[str, Any]:
    """Rank ``rank``'s ``Trainer.state_dict()`` from checkpoint ``path`` (size and CRC-32
    checked first, then loaded with ``weights_only=True``); :class:`CheckpointError`
    naming the file when it does not fit, :class:`RefusedCheckpoint` when it is of an
    earlier format or would have to be unpickled."""
    path = Path(path)
    meta = read_meta(path)
    if meta["world"] != world:
        raise CheckpointError(
            f"checkpoint {path} holds {meta['world']} ranks, this job has {world}: resume "
            f"with --workers {meta['world']} (under torchrun: {meta['world']} processes in all)"
        )
    file = path / f"rank-{rank}.pt"
    data = _read_rank(file)
    _check_bytes(file, data, meta["ranks"][rank])
    _check_format(path, meta)
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = str(exc).partition("WeightsUnpickler error: ")[2].partition(". ")[0] or str(exc).splitlines()[0]
        raise _refuse_unpickling(file, data, reason) from None
    except Exception as exc:  # noqa: BLE001 - any other loading error: name the file
        raise CheckpointError(f"checkpoint file {file} cannot be loaded: {exc}") from None


def resume_point(run_dir: Path, warn: Callable[[str], None]) -> Path | None:
    """The newest complete and whole checkpoint of ``run_dir``, or None when it has none.

    A damaged one (``meta.json`` or a rank's file missing, truncated, or with another
    CRC-32) is named in a warning, moved aside to ``step-<N>.corrupt``, and the previous
    complete one is tried; ``latest`` is rewritten to the one returned.

    Raises:
        UntrustedError: ``run_dir`` or a file read from it is not trusted
            (:mod:`shmtrain.runtime.trusted_files`), before anything is moved or written.
        RefusedCheckpoint: the newest whole checkpoint is of an earlier format or would
            have to be unpickled (it is left in place).
    """
    trusted_files.check_folder(run_dir)
    for path in reversed(complete_checkpoints(run_dir)):
        try:
            validate(path)
        except RefusedCheckpoint:
            raise
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
        ValueError: no run folder there, one that is not trusted (an ``UntrustedError``:
            :mod:`shmtrain.runtime.trusted_files`), or a given value conflicts with the
            run's (names the key and both values), before any worker starts.
    """
    folder = Path(run_dir)
    toml = folder / "config.toml"
    if not folder.is_dir():
        raise ValueError(f"--resume {run_dir}: no such folder; give the run folder of an earlier "
                         "`shmtrain train` (its --out)")
    if not toml.is_file():
        raise ValueError(f"--resume {run_dir}: {toml} is missing, so this is not a run folder of "
                         "`shmtrain train`; give the folder an earlier run wrote (its --out)")
    trusted_files.check_folder(folder)
    saved_values = read_toml(str(toml), "run file")
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
        saved = resolve(read_toml(str(toml), "checkpoint file"))
    except UntrustedError:
        raise
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
