"""Shared segments: naming, permissions, lifecycle, stitched views."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from shmtrain.fabric.shm.segment import SharedSegment, leftover, sweep
from shmtrain.fabric.shm.stitch import PAGE, StitchedView


def test_segment_is_private_zero_copy_and_unlinks() -> None:
    seg = SharedSegment("shmtrain-test-seg", 4096, create=True)
    try:
        mode = stat.S_IMODE(os.stat(f"/dev/shm/{seg.name}").st_mode)
        assert mode == 0o600
        other = SharedSegment(seg.name, 4096, create=False)
        a = seg.tensor(torch.float32, 0, 1024)
        b = other.tensor(torch.float32, 0, 1024)
        a.fill_(3.0)
        assert torch.all(b == 3.0)  # same memory, no copy
    finally:
        seg.unlink()
    assert "shmtrain-test-seg" not in leftover()
    a.add_(1.0)  # the mapping outlives the name
    assert torch.all(b == 4.0)


def test_segment_rejects_bad_names_and_sizes() -> None:
    with pytest.raises(ValueError, match="must start with"):
        SharedSegment("other", 64, create=True)
    with pytest.raises(ValueError, match="positive"):
        SharedSegment("shmtrain-x", 0, create=True)
    seg = SharedSegment("shmtrain-test-small", 64, create=True)
    try:
        with pytest.raises(ValueError, match="does not fit"):
            seg.tensor(torch.float32, 0, 17)
    finally:
        seg.unlink()


def test_sweep_removes_only_the_prefix() -> None:
    keep = SharedSegment("shmtrain-keepme", 64, create=True)
    gone = SharedSegment("shmtrain-sweepme-1", 64, create=True)
    try:
        assert sweep("shmtrain-sweepme") == [gone.name]
        assert Path("/dev/shm/shmtrain-keepme").exists()
    finally:
        keep.unlink()
    with pytest.raises(ValueError):
        sweep("notours")


def test_stitched_view_maps_pieces_back_to_back() -> None:
    floats = PAGE // 4
    seg = SharedSegment("shmtrain-test-stitch", 4 * PAGE, create=True)
    try:
        whole = seg.tensor(torch.float32, 0, 4 * floats)
        whole.copy_(torch.arange(4 * floats, dtype=torch.float32))
        # take page 3, then page 1, then half of page 0
        view = StitchedView(seg, [(3 * PAGE, PAGE), (PAGE, PAGE), (0, PAGE // 2)], torch.float32,
                            2 * floats + floats // 2)
        expected = torch.cat([whole[3 * floats : 4 * floats], whole[floats : 2 * floats], whole[: floats // 2]])
        assert torch.equal(view.tensor, expected)
        view.tensor[0] = -1.0  # writes go to the shared page
        assert whole[3 * floats] == -1.0
        view.close()
    finally:
        seg.unlink()
