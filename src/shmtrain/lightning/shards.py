"""Every rank's own state beside a Lightning checkpoint, for the methods whose ranks differ.

Lightning writes one checkpoint file, rank 0's. Under a synchronous method every rank's
weights and optimizer equal rank 0's, so that file resumes the job. Under an asynchronous
one (SEASGD, EASGD, Downpour, HSGD, DiLoCo, ps_weight) each rank has its own replica,
momentum and strategy state (the master's global weights W_g among them: only its owner
saves it, ``Strategy.state_dict``), so rank ``r`` > 0 also writes ``<checkpoint>.rank<r>``
(written under a temporary name, then renamed), and reads it back at resume.

A shard is loaded only when its owner is this user and nobody else can write it
(:func:`shmtrain.fabric.trust.check_path`), with ``torch.load(weights_only=True)``:
tensors, numbers, strings and containers, no other object rebuilt.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from shmtrain.fabric.trust import check_path


def shard_path(checkpoint: str | os.PathLike, rank: int) -> Path:
    """Where rank ``rank`` keeps its state beside ``checkpoint``."""
    return Path(f"{os.fspath(checkpoint)}.rank{rank}")


def save_shard(checkpoint: str | os.PathLike, rank: int, state: dict[str, Any]) -> Path:
    """Write ``state`` as rank ``rank``'s shard of ``checkpoint`` (atomically)."""
    path = shard_path(checkpoint, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_shard(checkpoint: str | os.PathLike, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s shard of ``checkpoint``, checked and loaded (module docstring)."""
    path = shard_path(checkpoint, rank)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: the checkpoint {os.fspath(checkpoint)} of an asynchronous shmtrain method needs "
            f"every rank's shard beside it (rank {rank}'s is not there); copy the .rank<N> files with the "
            "checkpoint, or resume from one that has them")
    check_path(path, "the checkpoint shard", "it must be this user's and writable by nobody else")
    return torch.load(path, weights_only=True, map_location="cpu")


def remove_shard(checkpoint: str | os.PathLike, rank: int) -> None:
    """Remove rank ``rank``'s shard of ``checkpoint`` (Lightning removed the checkpoint)."""
    shard_path(checkpoint, rank).unlink(missing_ok=True)
