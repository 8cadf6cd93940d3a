"""A job started without torchrun whose script makes the default process group first (the
way Lightning's launcher and ``mp.spawn`` run): shmtrain's context joins that group's store
instead of serving a second one on MASTER_PORT, so DataParallel works there."""

from __future__ import annotations

import sys

from conftest import at_once
from support.paths import SUPPORT
from support.torchrun import env, free_port


def test_dataparallel_joins_the_store_of_a_group_the_script_made() -> None:
    port = free_port()
    base = {**env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    for key in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        base.pop(key, None)
    script = str(SUPPORT / "own_group_script.py")
    done = at_once({rank: ([sys.executable, script], {**base, "RANK": str(rank)}) for rank in (0, 1)}, timeout=120)
    for rank, result in done.items():
        assert result.returncode == 0 and result.stdout.strip() == "ok", (rank, result.stdout, result.stderr[-3000:])
