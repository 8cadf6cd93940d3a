"""The memory server's snapshots: every global buffer with its key, in one file written atomically.

``shmtrain smb-server --snapshot-every S`` writes one; ``--resume FILE`` starts a server
from it (the buffers, their names and ids, and the count of accumulations applied).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from shmtrain.fabric.smb.api import BufferKey


def write_snapshot(path: str | Path, keys: dict[int, BufferKey], buffers: dict[int, torch.Tensor],
                   applied: int) -> None:
    """Write ``buffers`` and their ``keys`` to ``path`` (temporary file, fsync, rename)."""
    path = Path(path)
    state = {"keys": {i: key.encode() for i, key in keys.items()}, "buffers": buffers, "applied": applied}
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_snapshot(path: str | Path) -> tuple[dict[int, BufferKey], dict[int, torch.Tensor], int]:
    """The keys, buffers and accumulations applied of a snapshot :func:`write_snapshot` wrote."""
    state = torch.load(path, weights_only=True)
    keys = {int(i): BufferKey.decode(text) for i, text in state["keys"].items()}
    buffers = {int(i): tensor for i, tensor in state["buffers"].items()}
    return keys, buffers, int(state.get("applied", 0))
