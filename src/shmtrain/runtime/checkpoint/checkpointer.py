"""Checkpoints of ``shmtrain train``: layout, atomic writes, completion, validation, resume.

A checkpoint is every rank's :meth:`shmtrain.runtime.train.trainer.Trainer.state_dict` (model,
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

Writing: each rank writes ``rank-<r>.pt.part`` inside ``step-<N>.tmp``,
fsyncs it and renames it to ``rank-<r>.pt``, then records its size and CRC-32 in the
job's store and counts itself in (``store.add``). The rank whose count completes the
set, whichever it is, finishes the checkpoint: ``meta.json`` and ``config.toml``
(each written to a temporary name, fsynced, renamed), fsync of the folder, rename
``step-<N>.tmp`` -> ``step-<N>``, fsync of ``checkpoints/``, ``latest`` rewritten
atomically, then the oldest complete checkpoints beyond ``--keep-checkpoints`` are
removed. Nobody waits for anybody: asynchronous strategies keep their asynchrony, and
a rank that dies leaves an incomplete ``.tmp`` folder while the previous checkpoint stays
intact, unless its strategy trains on without it: then the others carry its last state
into each checkpoint (``runtime/checkpoint/lost_ranks.py``), which completes. Every rank
saves at the same iteration numbers (multiples of
``--checkpoint-every``, below the planned total); the final checkpoint, written when
a rank's loop ends (target reached, termination alignment, or an agreed stop), takes the
name the first finisher proposes (``store.compare_set``), so ranks of an asynchronous
strategy that end at different iterations still fill one folder.

Reading: :func:`resume_point` returns the newest complete checkpoint
whose files all have the recorded size and CRC-32; a damaged one is named, moved aside
to ``step-<N>.corrupt`` and the previous complete one is used, with a warning.
:func:`check_compatible` refuses a configuration other than the checkpoint's, naming
the key and both values (only the run length and harmless keys may change,
:data:`MAY_CHANGE`). A run folder and the files read from it must be trusted (this
user's, or listed in ``SHMTRAIN_TRUSTED``: :mod:`shmtrain.runtime.trusted_files`),
checked on the descriptor that is read. Files hold tensors, numbers, strings and
containers only (numpy's RNG state as a tensor: ``runtime/train/rng_state.py``; a
state holding anything else is refused when written) and are loaded with
``torch.load(weights_only=True)``, which rebuilds nothing else, so loading a checkpoint
never runs code; a checkpoint of an earlier format (``meta.json`` format 1, pickled
numpy objects) or one whose files name other objects is refused, not unpickled and not
moved aside.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shmtrain.runtime.checkpoint import lost_ranks
from shmtrain.runtime.checkpoint.files import (
    CHECKPOINTS,
    FORMAT,
    LATEST,
    CheckpointError,
    complete_checkpoints,
    latest,
    load_rank,
    save_file,
    step_of,
    tensor_bytes,
)
from shmtrain.runtime.config import TrainConfig, to_toml
from shmtrain.runtime.files import LineLog, cannot_write, fsync_dir, write_atomic
from shmtrain.runtime.outputs import metrics_tail
from shmtrain.runtime.train.finite import check_state


# -- the worker side ----------------------------------------------------------------------
class Checkpointer:
    """One rank's side of checkpoints: restore, save at the agreed iterations, finish.

    Args:
        ctx: the worker's ProcessContext (rank, world, the job's store).
        config: the run's configuration (``checkpoint_every``, ``keep_checkpoints``).
        out: the run folder.
        steps_per_epoch: iterations per epoch (the default interval).
        lost: the ranks known lost now (an asynchronous strategy's ``lost_now``): their
            last state is carried into each checkpoint (``runtime/checkpoint/lost_ranks.py``).
    """

    def __init__(self, ctx: Any, config: TrainConfig, out: Path, steps_per_epoch: int,
                 lost: Callable[[], set[int]] | None = None) -> None:
        self.ctx = ctx
        self.out = Path(out)
        self.folder = self.out / CHECKPOINTS
        every = config.checkpoint_every
        self.every = max(1, steps_per_epoch) if every is None else every
        self.keep = config.keep_checkpoints
        self.config_toml = to_toml(config)
        self.strategy = config.strategy
        self.lost = lost if lost is not None else set
        self._adopted: set[int] = set()  # lost ranks whose state this rank carried on (warned once)
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

    def open_metrics(self, path: Path, upto: int, keep: bool = False, tail: bool = False) -> LineLog:
        """This rank's metrics file: new for a fresh run; for a resumed one (or ``keep``: a
        rank whose host rejoined the job), its rows up to iteration ``upto`` kept (rows an
        interrupted run wrote after its checkpoint are dropped, so none is duplicated) and
        the file opened for appending. ``tail``: a worker replaced in place, or a survivor,
        whose rows past ``upto`` can only be at the end (a line its death cut short): the
        file is cut back from its end, not read whole."""
        path.parent.mkdir(parents=True, exist_ok=True)
        if tail and path.exists():
            metrics_tail.cut_after(path, upto)
            return LineLog(path)
        if (self.resumed_from is None and not keep) or not path.exists():
            return LineLog(path, truncate=True)
        kept = []
        for line in path.read_bytes().decode(errors="replace").splitlines():
            try:
                row = json.loads(line)
                iteration = row["eval"]["iteration"] if "eval" in row else row["iteration"]
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a kill
            if iteration <= upto:
                kept.append(line + "\n")
        write_atomic(path, "".join(kept).encode())
        return LineLog(path)

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
        ctx = self.ctx
        tmp = self.folder / f"step-{step}.tmp"
        file = tmp / f"rank-{ctx.rank}.pt"
        if not lost_ranks.claim(ctx.store, step, ctx.rank):
            return  # held for lost, its slot filled by another rank: the job goes on without it
        state = trainer.state_dict(copy=False)  # serialized at once: no snapshot copy
        last = latest(self.out)
        check_state(state, step, ctx.rank, str(last) if last else None)  # only finite ones are committed
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            size, crc = save_file(state, file)
        except OSError as exc:
            raise CheckpointError(self._cannot(file, exc, tensor_bytes(state))) from None
        record = {"rank": ctx.rank, "iteration": int(state["train"]["iteration"]), "bytes": size, "crc32": crc}
        ctx.store.set(f"ckpt/{step}/rank-{ctx.rank}", json.dumps(record))
        lost_ranks.note_state(ctx.store, step, ctx.rank)
        self.last = self.folder / f"step-{step}"
        self._count_in(step, tmp)
        for rank in sorted(self.lost()):  # the lost ranks' last state, so the checkpoint completes
            if lost_ranks.claim(ctx.store, step, rank):
                try:
                    lost_ranks.adopt(ctx.store, self.folder, step, rank, ctx.rank, file, self.resumed_from,
                                     warn=rank not in self._adopted)
                    self._adopted.add(rank)
                except OSError as exc:
                    raise CheckpointError(self._cannot(tmp / f"rank-{rank}.pt", exc)) from None
                self._count_in(step, tmp)

    def _count_in(self, step: int, tmp: Path) -> None:
        """Count one rank's file of checkpoint ``step`` in; the last one finishes it."""
        if self.ctx.store.add(f"ckpt/{step}/count", 1) == self.ctx.world_size:
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
