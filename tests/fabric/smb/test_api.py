"""The shared memory buffer service (SMB-API): keys, attach, read/write, accumulate, notify."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch

from shmtrain.fabric.smb import (
    STATE_TRAINING,
    BufferKey,
    LocalBufferService,
    LocalProgressBoard,
)
from shmtrain.fabric.transports import open_buffer_service
from shmtrain.runtime.launch.launcher import WorkerFailed, launch

NUMEL = 4099  # not a multiple of anything convenient


def pattern(numel: int = NUMEL) -> torch.Tensor:
    return (torch.arange(numel) % 7 + 1).to(torch.float32)


def api_worker(ctx, payload: Any) -> dict[str, Any]:
    smb = open_buffer_service(ctx, "local")
    out: dict[str, Any] = {"types": (type(smb), type(smb.board))}
    if smb.rank == 0:  # Fig. 2: the master creates and initialises, the others attach by key
        shared = smb.attach(smb.create("shared", NUMEL))
        smb.write(shared, pattern())
    mine = smb.attach(smb.create(f"mine.{smb.rank}", NUMEL))
    if smb.rank != 0:
        key = smb.lookup("shared")
        out["key_roundtrip"] = BufferKey.decode(key.encode()) == key
        shared = smb.attach(key)
    smb.ready()
    smb.write(mine, torch.full((NUMEL,), float(smb.rank + 1)))
    ticket = smb.accumulate(mine, shared)
    smb.wait(ticket)
    out["done"] = smb.done(ticket)
    ctx.host.barrier("all accumulated")
    out["shared"] = smb.read(shared, torch.empty(NUMEL))
    try:
        smb.accumulate(mine, smb.attach(smb.create(f"small.{smb.rank}", 3)))
    except ValueError as exc:
        out["size_error"] = str(exc)
    try:
        smb.create(f"mine.{smb.rank}", NUMEL)
    except ValueError as exc:
        out["name_error"] = str(exc)
    smb.board.set_progress(7 + smb.rank, STATE_TRAINING)
    ctx.host.barrier("progress published")
    out["progress"] = [smb.board.progress(r) for r in range(smb.world)]
    out["states"] = [smb.board.state(r) for r in range(smb.world)]
    out["alive"] = [smb.board.alive(r) for r in range(smb.world)]
    out["applied"] = smb.applied
    smb.close()
    return out


@pytest.mark.parametrize("workers", [1, 3])
def test_create_attach_read_write_accumulate(workers: int) -> None:
    results = launch("fabric.smb.test_api:api_worker", workers, None)
    expected = pattern() + sum(range(1, workers + 1))
    for rank, out in enumerate(results):
        assert torch.equal(out["shared"], expected), rank
        assert out["done"]
        assert out["types"] == (LocalBufferService, LocalProgressBoard)
        assert out["progress"] == [7 + r for r in range(workers)]
        assert out["states"] == [STATE_TRAINING] * workers
        assert out["alive"] == [True] * workers
        assert "cannot accumulate" in out["size_error"]
        assert "already taken" in out["name_error"]
        if rank:
            assert out["key_roundtrip"]
    assert results[0]["applied"] >= workers


def owner_death_worker(ctx, payload: Any) -> str:
    smb = LocalBufferService(ctx.host)
    if smb.rank == 0:
        target = smb.attach(smb.create("target", NUMEL))
    inc = smb.attach(smb.create(f"inc.{smb.rank}", NUMEL))
    if smb.rank:
        target = smb.attach(smb.lookup("target"))
    smb.ready()
    smb.board.set_progress(0, STATE_TRAINING)
    if smb.rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # the memory server goes away
    while smb.board.alive(0):
        time.sleep(0.01)
    smb.wait(smb.accumulate(inc, target), timeout=30)  # must raise, naming the owner
    return "unreachable"


def test_a_dead_owner_is_named_not_waited_for(capfd) -> None:
    start = time.monotonic()
    with pytest.raises(WorkerFailed):
        launch("fabric.smb.test_api:owner_death_worker", 2, None, tolerate_worker_loss=True, timeout=60)
    assert time.monotonic() - start < 25
    err = capfd.readouterr().err
    assert "SMB owner (local rank 0" in err and "died" in err


class _Untouchable:
    """A stand-in context that fails any use: the name must be checked first."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"open_buffer_service used ctx.{name} before checking the name")


def test_an_unknown_buffer_service_is_named() -> None:
    with pytest.raises(ValueError, match="'bogus'.*local"):
        open_buffer_service(_Untouchable(), "bogus")
