"""Checkpoints of ``shmtrain train``: layout, atomic writes, completion, validation, resume.

A checkpoint is every rank's :meth:`shmtrain.runtime.trainer.Trainer.state_dict` (model,
optimizer with its momentum buffers, the strategy's own state such as the master's
global weights W_g of SEASGD/EASGD/HSGD/Downpour or ps_weight's rounds, the
learning-rate scheduler, iterations done = the data position, every RNG state), one
``torch.save`` file per rank, plus the resolved configuration. Layout of a run folder::

    RUN_DIR/checkpoints/
        step-<N>/              a complete checkpoint; N = iterations done
            rank-<r>.pt        torch.save of rank r's Trainer.state_dict()
            meta.json          format, step, world, strategy; per rank: iteration, bytes, CRC-32
            config.toml        the resolved configuration it was written with
        step-<N>.tmp/          being written; never read, removed when a run (re)starts
        step-<N>.corrupt/      found damaged by a resume and moved aside (kept for inspection)
        latest                 "step-<N>": the newest complete checkpoint (written atomically)

Writing (issue item 1): each rank writes ``rank-<r>.pt.part`` inside ``step-<N>.tmp``,
fsyncs it and renames it to ``rank-<r>.pt``, then records its size and CRC-32 in the
job's store and counts itself in (``store.add``). The rank whose count completes the
set, whichever it is, finishes the checkpoint: ``meta.json`` and ``config.toml``
(each written to a temporary name, fsynced, renamed), fsync of the folder, rename
``step-<N>.tmp`` -> ``step-<N>``, fsync of ``checkpoints/``, ``latest`` rewritten
atomically, then the oldest complete checkpoints beyond ``--keep-checkpoints`` are
removed. Nobody waits for anybody: asynchronous strategies keep their asynchrony, and
a rank that dies leaves an incomplete ``.tmp`` folder while the previous checkpoint stays
intact. Every rank saves at the same iteration numbers (multiples of
``--checkpoint-every``, below the planned total); the final checkpoint, written when
a rank's loop ends (target reached, termination alignment, or an agreed stop), takes the
name the first finisher proposes (``store.compare_set``), so ranks of an asynchronous
strategy that end at different iterations still fill one folder.

Reading (issue items 2, 4, 7): :func:`resume_point` returns the newest complete checkpoint
whose files all have the recorded size and CRC-32; a damaged one is named, moved aside
to ``step-<N>.corrupt`` and the previous complete one is used, with a warning.
:func:`check_compatible` refuses a configuration other than the checkpoint's, naming
the key and both values (only the run length and harmless keys may change,
:data:`MAY_CHANGE`). Files are read with ``torch.load(weights_only=False)``: they hold
numpy's and Python's RNG states, and they are this run's own files.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import time
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import torch

from shmtrain.runtime.config import COMMON_KEYS, TrainConfig, read_toml, resolve, to_toml
from shmtrain.runtime.files import cannot_write, fsync_dir, replace_atomically, write_atomic

CHECKPOINTS = "checkpoints"
LATEST = "latest"
FORMAT = 1
_STEP = re.compile(r"^step-(\d+)$")

#: keys a resumed run may change: its length, and what does not touch the computation
MAY_CHANGE = frozenset({
    "iterations", "epochs", "out", "timeout", "progress", "verbose", "threads", "prefetch", "force",
    "checkpoint_every", "keep_checkpoints", "max_restarts",
    "eval_every", "tensorboard", "trace",
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
        meta = json.loads(file.read_text())
        if meta.get("format") != FORMAT or len(meta["ranks"]) != meta["world"]:
            raise ValueError(f"format {meta.get('format')!r}, {len(meta['ranks'])} of {meta['world']} ranks")
        return meta
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint file {file} is missing or damaged ({exc})") from None


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
    complete one is tried (issue item 7); ``latest`` is rewritten to the one returned.
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
        try:
            if not pointer.is_file() or pointer.read_text().strip() != path.name:
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


# -- the worker side ----------------------------------------------------------------------
class Checkpointer:
    """One rank's side of checkpoints: restore, save at the agreed iterations, finish.

    Args:
        ctx: the worker's ProcessContext (rank, world, the job's store).
        config: the run's configuration (``checkpoint_every``, ``keep_checkpoints``).
        out: the run folder.
        steps_per_epoch: iterations per epoch (the default interval).
    """

    def __init__(self, ctx: Any, config: TrainConfig, out: Path, steps_per_epoch: int) -> None:
        self.ctx = ctx
        self.out = Path(out)
        self.folder = self.out / CHECKPOINTS
        every = config.checkpoint_every
        self.every = max(1, steps_per_epoch) if every is None else every
        self.keep = config.keep_checkpoints
        self.config_toml = to_toml(config)
        self.strategy = config.strategy
        #: step of the checkpoint this run started from (None: a fresh run)
        self.resumed_from: int | None = None
        #: the last checkpoint this rank took part in
        self.last: Path | None = None

    # -- restore --------------------------------------------------------------------------
    def restore(self, trainer: Any, path: str | None) -> None:
        """Load this rank's state from checkpoint ``path`` (collective: every rank, before
        the first iteration); nothing when ``path`` is None."""
        if path is None:
            return
        state = load_rank(Path(path), self.ctx.rank, self.ctx.world_size)
        trainer.load_state_dict(state)
        self.resumed_from = step_of(path)
        self.last = Path(path)

    def open_metrics(self, path: Path, upto: int) -> TextIO:
        """This rank's metrics file: new for a fresh run; for a resumed one, its rows up to
        iteration ``upto`` kept (rows an interrupted run wrote after its checkpoint are
        dropped, so none is duplicated) and the file opened for appending."""
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.resumed_from is None or not path.exists():
            return open(path, "w")  # noqa: SIM115 - the loop closes it
        kept = []
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
                iteration = row["eval"]["iteration"] if "eval" in row else row["iteration"]
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a kill
            if iteration <= upto:
                kept.append(line + "\n")
        write_atomic(path, "".join(kept).encode())
        return open(path, "a")  # noqa: SIM115 - the loop closes it

    # -- save -----------------------------------------------------------------------------
    def due(self, iteration: int, total: int) -> bool:
        """Whether this iteration ends with a checkpoint (the final one is apart)."""
        return self.every > 0 and iteration % self.every == 0 and iteration < total

    def save(self, trainer: Any, step: int) -> None:
        """Write this rank's file of checkpoint ``step``; the rank completing the set
        finishes the checkpoint (see the module docstring).

        Raises:
            CheckpointError: a file could not be written (names it; the previous
                checkpoint stays intact).
        """
        state = trainer.state_dict(copy=False)  # serialized at once: no snapshot copy
        ctx = self.ctx
        tmp = self.folder / f"step-{step}.tmp"
        file = tmp / f"rank-{ctx.rank}.pt"
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            size, crc = save_file(state, file)
        except OSError as exc:
            raise CheckpointError(self._cannot(file, exc, tensor_bytes(state))) from None
        record = {"rank": ctx.rank, "iteration": int(state["train"]["iteration"]), "bytes": size, "crc32": crc}
        ctx.store.set(f"ckpt/{step}/rank-{ctx.rank}", json.dumps(record))
        self.last = self.folder / f"step-{step}"
        if ctx.store.add(f"ckpt/{step}/count", 1) == ctx.world_size:
            self._complete(step, tmp)

    def save_final(self, trainer: Any, proposal: int) -> Path | None:
        """The checkpoint at the end of this rank's loop, named by the first rank to end
        (``proposal``, at least its own iteration count); skipped when that is the
        checkpoint the run started from (nothing new to save). Returns its folder."""
        proposal = max(proposal, trainer.state.iteration)
        step = int(self.ctx.store.compare_set("ckpt/final", "", str(proposal)).decode())
        if step == self.resumed_from:
            return self.last
        self.save(trainer, step)
        return self.folder / f"step-{step}"

    def _cannot(self, path: Path, exc: OSError, needed: int | None = None) -> str:
        previous = latest(self.out)
        kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        return (f"{cannot_write(path, exc, needed)} (a checkpoint); {kept}; free space or "
                f"fix the folder, then continue with: shmtrain train --resume {self.out}")

    def _complete(self, step: int, tmp: Path) -> None:
        """Every rank's file is in ``tmp``: write meta.json and config.toml, rename the
        folder to ``step-<N>``, point ``latest`` at it, prune (the last rank does this)."""
        ctx = self.ctx
        records = [json.loads(ctx.store.get(f"ckpt/{step}/rank-{r}")) for r in range(ctx.world_size)]
        meta = {"format": FORMAT, "step": step, "world": ctx.world_size, "strategy": self.strategy,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "ranks": records}
        final = self.folder / f"step-{step}"
        try:
            write_atomic(tmp / "meta.json", (json.dumps(meta, indent=1) + "\n").encode())
            write_atomic(tmp / "config.toml", self.config_toml.encode())
            if final.exists():  # only when a resumed run rewrites a step: keep no stale copy
                shutil.rmtree(final)
            os.rename(tmp, final)
            fsync_dir(self.folder)
            write_atomic(self.folder / LATEST, f"{final.name}\n".encode())
        except OSError as exc:
            raise CheckpointError(self._cannot(Path(exc.filename or final), exc)) from None
        self.prune(step)

    def prune(self, step: int) -> None:
        """Keep the newest ``keep_checkpoints`` complete checkpoints (0: all); drop the
        unfinished folders of earlier steps (asynchronous ranks that ended before them)."""
        complete = complete_checkpoints(self.out)
        if self.keep > 0:
            for path in complete[: max(0, len(complete) - self.keep)]:
                shutil.rmtree(path, ignore_errors=True)
        for path in self.folder.glob("step-*.tmp"):
            n = step_of(path.name[: -len(".tmp")])
            if n is not None and n < step:
                shutil.rmtree(path, ignore_errors=True)
