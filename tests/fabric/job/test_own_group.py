"""A job started without torchrun whose script makes the default process group first (the
way Lightning's launcher and ``mp.spawn`` run): shmtrain's context joins that group's store
instead of serving a second one on MASTER_PORT, so DataParallel works there."""

from __future__ import annotations

import sys

from conftest import at_once
from support.paths import SUPPORT
from support.script_exit import ended_well
from support.torchrun import env, free_port


def test_dataparallel_joins_the_store_of_a_group_the_script_made() -> None:
    port = free_port()
    base = {**env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    for key in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        base.pop(key, None)
    script = str(SUPPORT / "own_group_script.py")
    done = at_once({rank: ([sys.executable, script], {**base, "RANK": str(rank)}) for rank in (0, 1)}, timeout=120)
    for rank, result in done.items():
        assert ended_well(result, "ok"), (rank, result.returncode, result.stdout, result.stderr[-3000:])


def test_only_torchs_teardown_abort_after_the_last_line_passes() -> None:
    """The judge above lets torch's teardown abort through only after the last line."""
    from subprocess import CompletedProcess

    abort = "terminate called without an active exception\n"
    assert ended_well(CompletedProcess([], 0, "ok\n", ""), "ok")
    assert ended_well(CompletedProcess([], -6, "ok\n", "warning\n" + abort), "ok")
    assert not ended_well(CompletedProcess([], -6, "", abort), "ok")  # before the last line
    assert not ended_well(CompletedProcess([], -6, "ok\n", "Segmentation fault\n"), "ok")
    assert not ended_well(CompletedProcess([], 1, "ok\n", abort), "ok")
    assert not ended_well(CompletedProcess([], 0, "ok\nmore\n", ""), "ok")
