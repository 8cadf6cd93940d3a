"""Checkpoints of a run that trains on without a lost rank: its last state is carried on.

An asynchronous strategy (SEASGD, EASGD, Downpour, HSGD) goes on when a worker dies; a
checkpoint, though, is complete only with every rank's file. So each rank that saves a
checkpoint also *adopts* the ranks its strategy knows lost (``Strategy.lost_now``): for
each, the first rank to claim it in the job's store (``ckpt/<N>/claim-<r>``, an ``add``
only one caller sees return 1) copies the lost rank's newest file (the step the store
names in ``ckpt/last/rank-<r>``, or the checkpoint the run resumed from) into
``step-<N>.tmp`` and counts it in, so the checkpoint completes, ``latest`` advances and a
``--resume`` continues from the survivors' last iteration, the lost rank from its own
last state. The rank's record in ``meta.json`` says so (``"lost": {"state_of": M}``), and
the adopter's log has one warning line. A rank lost before its first checkpoint of a
fresh run has no state to carry: the adopter's own file stands in for it (its record says
``"state_of_rank"``), a start as good as any for an asynchronous method's worker; so does
it for a rank whose file this rank cannot read (a run folder not shared across hosts).

A rank claims its own slot too, before it writes its file, so a slot is filled once.
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path
from typing import Any

from shmtrain.runtime.checkpoint.files import read_meta
from shmtrain.runtime.files import write_atomic


def claim(store: Any, step: int, rank: int) -> bool:
    """Whether this caller is the first to fill rank ``rank``'s slot of checkpoint ``step``."""
    return store.add(f"ckpt/{step}/claim-{rank}", 1) == 1


def note_state(store: Any, step: int, rank: int) -> None:
    """Rank ``rank``'s newest state is now the file of checkpoint ``step``."""
    store.set(f"ckpt/last/rank-{rank}", str(step))


def last_state(store: Any, rank: int, resumed_from: int | None) -> int | None:
    """The step whose folder holds rank ``rank``'s newest file (None: it has none)."""
    key = f"ckpt/last/rank-{rank}"
    if store.check([key]):
        return int(store.get(key).decode())
    return resumed_from


def _record_of(store: Any, folder: Path, step: int, rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s record (iteration, bytes, crc32) of checkpoint ``step``: from the
    store (written by this run) or the complete checkpoint's ``meta.json``."""
    key = f"ckpt/{step}/rank-{rank}"
    if store.check([key]):
        return json.loads(store.get(key))
    complete = folder / f"step-{step}"
    if (complete / "meta.json").exists():
        return dict(read_meta(complete)["ranks"][rank])
    return None


def _source(folder: Path, step: int, rank: int) -> bytes | None:
    """The bytes of rank ``rank``'s file of checkpoint ``step`` (complete or still being
    written; the folder may be renamed meanwhile: both names are tried, twice)."""
    for _ in range(2):
        for name in (f"step-{step}", f"step-{step}.tmp"):
            try:
                return (folder / name / f"rank-{rank}.pt").read_bytes()
            except FileNotFoundError:
                continue
    return None


def adopt(store: Any, folder: Path, step: int, rank: int, me: int, own: Path,
          resumed_from: int | None, warn: bool = True) -> dict[str, Any]:
    """Copy lost rank ``rank``'s newest file into ``step-<step>.tmp`` (the caller has
    claimed its slot); ``own`` is the adopter's file there (the stand-in when the lost rank
    has none). Returns the record for ``meta.json`` (also put in the store); ``warn``: say
    so on stderr (the adopter's log)."""
    tmp = folder / f"step-{step}.tmp"
    source_step = last_state(store, rank, resumed_from)
    data = record = None
    if source_step is not None:
        data = _source(folder, source_step, rank)
        record = _record_of(store, folder, source_step, rank) if data is not None else None
    if data is not None and record is not None:
        lost = dict(record.get("lost") or {"state_of": source_step})  # carried on: where it was made
        iteration = int(record["iteration"])
        made = f"checkpoint step-{lost['state_of']}" if "state_of" in lost else f"rank {lost['state_of_rank']}"
        said = f"its state of {made} (iteration {iteration})"
    else:
        data = own.read_bytes()
        iteration = int(json.loads(store.get(f"ckpt/{step}/rank-{me}"))["iteration"])
        lost = {"state_of_rank": me}
        said = (f"no state of its own (it was lost before its first checkpoint, or its file is on another "
                f"host's disk): rank {me}'s stands in")
    write_atomic(tmp / f"rank-{rank}.pt", data)
    entry = {"rank": rank, "iteration": iteration, "bytes": len(data), "crc32": zlib.crc32(data), "lost": lost}
    store.set(f"ckpt/{step}/rank-{rank}", json.dumps(entry))
    note_state(store, step, rank)
    if warn:
        print(f"shmtrain: warning: worker rank {rank} is lost; checkpoint step-{step} keeps {said} (and so "
              "do the next ones), so a --resume continues the others from their own iterations",
              file=sys.stderr, flush=True)
    return entry
