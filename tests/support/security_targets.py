"""Worker functions and the attacker's script for tests/fabric/test_trust.py.

The attacker runs as another local user (``nobody``): it waits for the port a victim's
worker reports (what ``ss -ltn`` shows any local user), connects to the job's store
there and writes pickles that would run code (create a marker file) into every key the
launcher and its workers used to read (``payload``, ``result/<r>``, ``error/<r>``), and
tries to write into the launchers' private folders in /tmp; it reports what it managed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def victim(ctx: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """Report the job's store port (if it has one) and hold the job open while the
    attacker works, then return the payload's value."""
    folder = Path(payload["folder"])
    if ctx.rank == 0:
        (folder / "port.tmp").write_text(os.environ.get("MASTER_PORT", "none"))
        os.replace(folder / "port.tmp", folder / "port")
    deadline = time.monotonic() + 60
    while not (folder / "attacked").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"rank": ctx.rank, "value": payload["value"]}


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def attack(folder: Path, seconds: float) -> dict[str, Any]:
    import pickle
    from datetime import timedelta

    import torch.distributed as dist

    done: dict[str, Any] = {"store": None, "files": []}
    deadline = time.monotonic() + 60
    while not (folder / "port").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    port = (folder / "port").read_text()
    evil = pickle.dumps(_Evil(str(folder / "marker")))
    stores = []
    if port.isdigit():
        try:
            stores.append(dist.TCPStore("127.0.0.1", int(port), None, False, timedelta(seconds=5)))
            done["store"] = "connected"
        except RuntimeError as exc:
            done["store"] = f"refused: {exc}"
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for store in list(stores):
            try:
                for key in ("payload", "result/0", "result/1", "error/0", "error/1"):
                    store.set(key, evil)
                done["store"] = "written"
            except RuntimeError:  # the job ended: its store with it
                stores.remove(store)
        for job in Path("/tmp").glob("shmtrain-job-*"):
            for name in ("payload", "result-0", "result-1"):
                try:
                    (job / name).write_bytes(evil)
                    done["files"].append(str(job / name))
                except OSError:
                    pass
        time.sleep(0.01)
        if time.monotonic() > end - seconds / 2:
            (folder / "attacked").touch()
    (folder / "attacked").touch()
    return done


if __name__ == "__main__":
    report = attack(Path(sys.argv[1]), float(sys.argv[2]))
    Path(sys.argv[1], "report.json").write_text(json.dumps(report))
