"""The rank shards beside a Lightning checkpoint (src/shmtrain/lightning/shards.py): written
atomically, read back only when this user's and nobody else's to write, never unpickling
anything but tensors and containers; a missing one is named with the fix."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from shmtrain.fabric.trust import UntrustedError
from shmtrain.lightning.shards import load_shard, remove_shard, save_shard, shard_path


def test_a_shard_round_trips_and_is_removed(tmp_path: Path) -> None:
    ckpt = tmp_path / "epoch=0.ckpt"
    state = {"model": {"w": torch.arange(4.0)}, "strategy": {"iteration": 8}}
    path = save_shard(ckpt, 1, state)
    assert path == shard_path(ckpt, 1) == tmp_path / "epoch=0.ckpt.rank1"
    assert not list(tmp_path.glob("*.tmp"))
    back = load_shard(ckpt, 1)
    assert torch.equal(back["model"]["w"], state["model"]["w"]) and back["strategy"] == {"iteration": 8}
    remove_shard(ckpt, 1)
    assert not path.exists()


def test_a_shard_others_can_write_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "epoch=0.ckpt"
    save_shard(ckpt, 1, {"strategy": {"iteration": 1}})
    os.chmod(shard_path(ckpt, 1), 0o666)
    with pytest.raises(UntrustedError, match="the checkpoint shard .* refused: it must be this user's"):
        load_shard(ckpt, 1)


class Planted:
    """An object whose unpickling would run a command (it touches ``marker``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_shard_with_a_pickled_object_is_not_run(tmp_path: Path) -> None:
    ckpt, marker = tmp_path / "epoch=0.ckpt", tmp_path / "ran"
    with open(shard_path(ckpt, 1), "wb") as f:
        pickle.dump({"strategy": Planted(marker)}, f, protocol=2)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_shard(ckpt, 1)
    assert not marker.exists()


def test_a_missing_shard_is_named_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"epoch=0.ckpt.rank2 is missing: .* copy the .rank<N> files"):
        load_shard(tmp_path / "epoch=0.ckpt", 2)
