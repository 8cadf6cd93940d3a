"""Where a run of ``shmtrain train`` starts: its folder, the checkpoint it resumes, and
whether its schedule may go on (a resume to another length of a schedule drawn over the
run is refused, or restarted by ``--restart-schedule``)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

from shmtrain.runtime.checkpoint import files as checkpoint_files
from shmtrain.runtime.config import TrainConfig
from shmtrain.runtime.run.end import warn


def default_out(config: TrainConfig) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{config.strategy}"

def starting_point(out: Path, config: TrainConfig, resume: bool) -> Path | None:
    """The checkpoint a local run starts from: the newest whole one with ``resume``
    (checked against ``config``); none for a new run, whose folder must hold none."""
    if not resume:
        existing = checkpoint_files.latest(out)
        if existing is not None:
            raise ValueError(
                f"--out {out} already holds a run with checkpoints ({existing}); continue it with: "
                f"shmtrain train --resume {out}, or give a new folder with --out"
            )
        return None
    found = checkpoint_files.complete_checkpoints(out)
    point = checkpoint_files.resume_point(out, warn)
    if point is None:
        raise ValueError(no_checkpoint(out, found))
    checkpoint_files.check_compatible(point, config)
    done = max(r["iteration"] for r in checkpoint_files.read_meta(point)["ranks"])
    if config.iterations is not None and config.iterations < done:
        raise ValueError(
            f"--iterations {config.iterations}: the run has done {done} iterations already "
            f"({point}); --iterations is the run's total, not the iterations to add: give "
            f"--iterations {done} or more"
        )
    return point

def check_schedule(point: Path, config: TrainConfig, train_samples: int, restart: bool) -> None:
    """Refuse a resume to another length of a schedule drawn over the run's planned
    iterations (a finished cosine run extended would train at --lr-min), unless
    ``restart`` (``--restart-schedule``)."""
    from shmtrain.runtime.config import read_toml, resolve
    from shmtrain.runtime.run.loop import planned_iterations
    from shmtrain.runtime.train.schedule import extended_resume

    saved = resolve(read_toml(str(point / "config.toml"), "checkpoint file"))
    facts = SimpleNamespace(train_samples=train_samples)
    planned = planned_iterations(saved, facts, config.workers)
    total = planned_iterations(config, facts, config.workers)
    done = max(r["iteration"] for r in checkpoint_files.read_meta(point)["ranks"])
    flag = f"--iterations {config.iterations}" if config.iterations is not None else f"--epochs {config.epochs:g}"
    problem = extended_resume(config, planned, done, total, flag)
    if problem is not None and not restart:
        raise ValueError(f"--resume {point.parent.parent}: {problem}")

def no_checkpoint(out: Path, found: list[Path]) -> str:
    """Why ``--resume out`` has nothing to continue from (``found``: the complete
    checkpoints there before the resume looked at them)."""
    folder = out / checkpoint_files.CHECKPOINTS
    unfinished = sorted(p.name for p in folder.glob("step-*.tmp")) if folder.is_dir() else []
    if found:
        why = (f"every one was damaged ({', '.join(p.name for p in found)}: each named above and moved "
               "aside to step-<N>.corrupt)")
    elif unfinished:
        why = f"the run ended while writing its first one ({unfinished[0]} is unfinished)"
    else:
        why = "the run ended before its first one"
    return (f"--resume {out}: no complete checkpoint in {folder} ({why}); start the run again, in "
            "this folder or another --out")
