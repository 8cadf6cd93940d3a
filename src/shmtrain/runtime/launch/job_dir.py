"""A local launch's private folder: the workers' payload, their results and error reports.

What the launcher and its workers hand each other outside torch.distributed's own
rendezvous goes through files in one directory that this user alone can enter (mode
0700, ``mkdtemp``), checked for owner before each read, never through a store: a store
that listens can be written by anyone who reaches it, and the payload and the results
are pickles, which run code when read. Under ``shmtrain train`` the job's store itself
is a ``FileStore`` in the same folder (no listening socket at all: ``store``); a
``shmtrain run`` script joins by ``env://``, which needs a TCPStore: the launcher's
listens on loopback alone (:func:`shmtrain.fabric.trust.bound_store`). The folder goes
with the launch (:meth:`JobDir.remove`).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
from pathlib import Path
from typing import Any

from shmtrain.fabric.trust import private_dir, read_private, write_private

#: the environment variable that names the folder to the workers
ENV = "SHMTRAIN_JOB_DIR"


class JobDir:
    """The private folder of one local launch (``path``)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def make(cls) -> JobDir:
        return cls(private_dir("shmtrain-job-"))

    @classmethod
    def from_env(cls) -> JobDir | None:
        """The launcher's folder, in one of its workers (None outside a local launch)."""
        path = os.environ.get(ENV)
        return cls(Path(path)) if path else None

    @property
    def store(self) -> str:
        """The path of the job's FileStore (``shmtrain train``)."""
        return str(self.path / "store")

    def put_payload(self, payload: Any) -> None:
        write_private(self.path / "payload", pickle.dumps(payload))

    def payload(self) -> Any:
        return pickle.loads(read_private(self.path / "payload", "the job's payload"))

    def put_result(self, rank: int, result: Any) -> None:
        write_private(self.path / f"result-{rank}", pickle.dumps(result))

    def result(self, rank: int) -> Any:
        return pickle.loads(read_private(self.path / f"result-{rank}", f"worker rank {rank}'s result"))

    def put_error(self, rank: int, record: dict[str, Any]) -> None:
        write_private(self.path / f"error-{rank}", json.dumps(record).encode())

    def error(self, rank: int, wait: float = 1.0) -> dict[str, Any]:
        """Worker ``rank``'s own account of its failure (``cause``, ``peer``, ``timeout``),
        waited for up to ``wait`` s (the worker writes it just before it exits); empty
        when it gave none."""
        path = self.path / f"error-{rank}"
        deadline = time.monotonic() + wait
        while not path.exists():
            if time.monotonic() > deadline:
                return {}
            time.sleep(0.02)
        try:
            return json.loads(read_private(path, f"worker rank {rank}'s error report"))
        except (OSError, ValueError):
            return {}

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
