"""The job's own memory server: started next to global rank 0, its files and its secret.

A job whose asynchronous workers span hosts and that was given no ``--smb-server``
gets one memory server (ShmCaffe's remote SMB, Ahn et al., Section III-B, Fig. 7),
started by global rank 0 on the address that routes to ``MASTER_ADDR``, with a secret
made for the job (:func:`secrets.token_hex`):

- its files (the address it reports, its log) live in a directory only this user can
  enter (:func:`~shmtrain.fabric.trust.private_dir`), each checked for owner and mode
  before it is read (:func:`~shmtrain.fabric.trust.read_private`); the server removes
  the directory when it ends cleanly (it keeps it, with its log, after an error);
- its address goes through the job's store (``smb/auto``): it is no secret, and a
  replaced one leads the clients to a server that cannot prove the secret, which they
  refuse (:mod:`~shmtrain.fabric.smb.handshake`);
- its secret never does: rank 0 sends it to the other workers over the job's gloo
  process group (a broadcast between the job's own processes, in clear: gloo does not
  encrypt), and each worker keeps it for a later start of its host in a private
  directory of its own (the path in the store, ``smb/stash/<rank>``; removed when its
  service closes), where a worker of that host started again reads it.

:func:`start_memory_server` does all of it (collective among the job's first start).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from shmtrain.fabric.shm.control import PeerFailure
from shmtrain.fabric.smb.wire import SECRET_ENV, route_address
from shmtrain.fabric.trust import UntrustedError, private_dir, read_private, write_private

#: the bytes of a job's secret (``secrets.token_hex(32)``)
SECRET_BYTES = 64
#: the names of the server's files in its private directory
ADDRESS, LOG = "address", "server.log"
#: the name prefix of a worker's folder of its kept secret (in the temporary directory)
STASH = "shmtrain-smb-secret-"


@dataclass
class Preforked:
    """A memory server forked by rank 0 before it joined the job
    (``shmtrain.runtime.launch.smb_server.prefork``)."""

    pid: int
    folder: Path
    secret: str
    world: int


#: the server :func:`start_memory_server` takes instead of starting one
PREFORKED: Preforked | None = None
#: this process's kept secrets, by the server's address (removed by :func:`forget`)
_KEPT: dict[str, Path] = {}


def server_files() -> Path:
    """A new private directory for a memory server's address file and log."""
    return private_dir("shmtrain-smb-")


def server_argv(world: int, timeout: float, folder: Path) -> list[str]:
    """``shmtrain smb-server``'s arguments for the job's own server (its files in ``folder``)."""
    bind = route_address(os.environ.get("MASTER_ADDR", "127.0.0.1"))
    return ["--clients", str(world), "--bind", bind, "--port", "0", "--timeout", str(timeout),
            "--idle-exit", str(timeout), "--address-file", str(folder / ADDRESS), "--log-file", str(folder / LOG),
            "--private-dir", str(folder)]


class _Forked:
    """``Popen.poll`` for a forked child: its exit status once it ended, else None."""

    def __init__(self, pid: int) -> None:
        self.pid, self.status = pid, None

    def poll(self) -> int | None:
        if self.status is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.status = os.waitstatus_to_exitcode(status)
        return self.status


def start_memory_server(store: dist.Store, rank: int, world: int, *, timeout: float,
                        rejoined: bool = False) -> tuple[str, bytes]:
    """Start the job's memory server next to global rank 0 (collective among the workers
    of the job's first start: ``torchrun --nnodes N ... --strategy seasgd`` needs nothing
    else); returns its address and the secret every client proves. A worker whose host
    started again (``rejoined``) takes both from the running job: the address from the
    store, the secret from what its rank kept (:func:`kept_secret`).

    The server runs in its own session, so it outlives the loss of rank 0; it ends when
    every client has said goodbye, or after ``timeout`` seconds without any request (a
    job whose workers are all gone).
    """
    if rejoined:
        _drop_preforked()  # rank 0 started again: the job's server still runs
        address = json.loads(store.get("smb/auto"))["address"]
        return address, kept_secret(store, rank, address)
    if rank == 0:
        address, secret = _start(world, timeout)
        store.set("smb/auto", json.dumps({"address": address}))
    else:
        address, secret = json.loads(store.get("smb/auto"))["address"], b""
    secret = share_secret(secret, rank, world)
    keep_secret(store, rank, address, secret)
    return address, secret


def _start(world: int, timeout: float) -> tuple[str, bytes]:
    """Rank 0's part: the server (the forked one, else a new process) and its address."""
    global PREFORKED
    proc: _Forked | subprocess.Popen
    if PREFORKED is not None and PREFORKED.world == world:  # forked before joining: no new interpreter
        proc, folder, secret, PREFORKED = _Forked(PREFORKED.pid), PREFORKED.folder, PREFORKED.secret, None
    else:
        _drop_preforked()
        folder, secret = server_files(), secrets.token_hex(32)
        sink = os.open(folder / LOG, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            argv = [sys.executable, "-m", "shmtrain", "smb-server", *server_argv(world, timeout, folder)]
            proc = subprocess.Popen(argv, env={**os.environ, SECRET_ENV: secret}, stdin=subprocess.DEVNULL,
                                    stdout=sink, stderr=sink, start_new_session=True)
        finally:
            os.close(sink)
    path = folder / ADDRESS
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise PeerFailure(f"the memory server did not start (exit status {proc.poll()}); see {folder / LOG}")
        time.sleep(0.05)
    address = read_private(path, "the memory server's address file").decode().strip()
    path.unlink()
    return address, secret.encode()


def _drop_preforked() -> None:
    """End a server forked before joining that is not needed (a host started again
    joins the running job's server) and remove its files."""
    global PREFORKED
    if PREFORKED is None:
        return
    pid, folder, PREFORKED = PREFORKED.pid, PREFORKED.folder, None
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    shutil.rmtree(folder, ignore_errors=True)


def share_secret(secret: bytes, rank: int, world: int) -> bytes:
    """Rank 0's ``secret`` on every rank, sent over the job's gloo process group (not
    through the store, which anyone who reaches its port can read)."""
    if world == 1:
        return secret
    if not dist.is_initialized():
        raise PeerFailure("the job's memory server's secret goes to the workers over the job's process group, "
                          "and this worker is in none; start the job with torchrun or shmtrain train")
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    data = torch.zeros(SECRET_BYTES, dtype=torch.uint8)
    if rank == 0:
        data[:len(secret)] = torch.frombuffer(bytearray(secret), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=group)
    return bytes(data.tolist()).rstrip(b"\0")


def keep_secret(store: dist.Store, rank: int, address: str, secret: bytes) -> None:
    """Keep ``secret`` for a later start of this worker's host (a private directory; its
    path, no secret, in the store as ``smb/stash/<rank>``); removed by :func:`forget`."""
    folder = private_dir(STASH)
    write_private(folder / "secret", secret)
    _KEPT[address] = folder
    store.set(f"smb/stash/{rank}", str(folder))


def kept_secret(store: dist.Store, rank: int, address: str) -> bytes:
    """The secret this rank's earlier start kept (:func:`keep_secret`), now this
    process's to remove; a worker on a host that does not have it cannot rejoin. The
    store is anyone's: the folder it names is used only if it is such a folder (its name,
    in the temporary directory) and this user's alone (:func:`~shmtrain.fabric.trust.read_private`)."""
    key = f"smb/stash/{rank}"
    folder = Path(store.get(key).decode(errors="replace")) if store.check([key]) else None
    try:
        if folder is None:
            raise FileNotFoundError("the job's store names none")
        if folder.parent != Path(tempfile.gettempdir()) or not folder.name.startswith(STASH):
            raise FileNotFoundError(f"{str(folder)!r} is not a folder of kept secrets ({STASH}* in "
                                    f"{tempfile.gettempdir()})")
        secret = read_private(folder / "secret", "the memory server's secret kept by this rank's earlier start")
    except (OSError, UntrustedError) as exc:
        raise PeerFailure(
            f"rank {rank} started again but cannot rejoin the job's memory server at {address}: its secret, kept by "
            f"this rank's earlier start on this host in {folder}, cannot be read ({exc}); a host that comes back "
            "without its temporary folder (another machine, or it was cleared) cannot rejoin a job's own server: "
            "run `shmtrain smb-server --secret-file FILE` yourself and pass --smb-server for such jobs") from None
    _KEPT[address] = folder
    return secret


def forget(address: str) -> None:
    """Remove the secret this process kept for the server at ``address`` (its service closed)."""
    folder = _KEPT.pop(address, None)
    if folder is not None:  # the one file, then the folder if nothing else is in it
        (folder / "secret").unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            folder.rmdir()


@atexit.register
def _forget_all() -> None:
    for address in list(_KEPT):
        forget(address)
