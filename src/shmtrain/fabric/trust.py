"""Trust at the edges of a run: what this user alone owns, and stores that listen on one address.

shmtrain trusts the user who starts a run (and root), and nobody else: not other local
users, not whoever can reach the host's network, not a file someone else wrote
(``docs/security.md``). These are the checks every edge makes before it uses what it
finds: a file, directory or shared-memory segment is used only if this user owns it and
no one else can write it (a segment: no one else can open it), checked on the open
descriptor (no race between the check and the use); files shmtrain makes outside a run
folder live in a private directory (mode 0700, :func:`tempfile.mkdtemp`); a
torch.distributed store that must listen does so on the address asked for only
(:func:`bound_store`: a TCPStore's own server listens on every interface whatever host
name it is given).
"""

from __future__ import annotations

import datetime
import os
import socket
import stat
import tempfile
from pathlib import Path
from typing import Any


class UntrustedError(ValueError):
    """A file, folder, segment or peer that this user cannot trust: one line naming it,
    who owns it or what failed to check, and the fix."""


def owner_name(uid: int) -> str:
    """``name (uid N)`` of a user id, or ``uid N`` where it has no name."""
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def untrusted(st: os.stat_result, *, private: bool = False) -> str | None:
    """Why a file of status ``st`` cannot be trusted by this user, or None: owned by
    another user, or writable by others (``private``: readable or writable by anyone
    but its owner)."""
    me = os.geteuid()
    if st.st_uid != me:
        return f"is owned by {owner_name(st.st_uid)}, not by {owner_name(me)} who runs shmtrain"
    mode = stat.S_IMODE(st.st_mode)
    if private and mode & 0o077:
        return f"has mode {mode:04o}: others can open it (shmtrain makes its own 0600)"
    if mode & 0o002:
        return f"has mode {mode:04o}: every user can write it"
    return None


def check_fd(fd: int, what: str, fix: str, *, private: bool = False) -> None:
    """Raise :class:`UntrustedError` unless the file open at ``fd`` is this user's
    (:func:`untrusted`); ``what`` names it, ``fix`` says what to do."""
    why = untrusted(os.fstat(fd), private=private)
    if why:
        raise UntrustedError(f"{what} {why}; refused: {fix}")


def check_path(path: str | os.PathLike, what: str, fix: str, *, private: bool = False) -> None:
    """:func:`check_fd` by path (not following a symbolic link at the end)."""
    why = untrusted(os.lstat(path), private=private)
    if why:
        raise UntrustedError(f"{what} {str(path)!r} {why}; refused: {fix}")


def private_dir(prefix: str = "shmtrain-") -> Path:
    """A new directory only this user can enter (mode 0700, made by ``mkdtemp``: a name
    no one can predict or make first)."""
    return Path(tempfile.mkdtemp(prefix=prefix))


def read_private(path: Path, what: str) -> bytes:
    """The bytes of a file in a private directory of this run, after checking that the
    file and its directory are this user's alone (no link followed)."""
    check_path(path.parent, f"{what}'s directory", "it is not the one this run made", private=True)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        check_fd(fd, f"{what} {str(path)!r}", "it is not the one this run wrote", private=True)
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file of mode 0600, then a rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def bound_store(bind: str, port: int = 0, *, timeout: float = 120.0, world_size: int | None = None) -> Any:
    """A TCPStore server that listens on ``bind`` alone (``port`` 0: one the kernel picks):
    its socket is made and bound here and handed to the store (``master_listen_fd``),
    since a TCPStore's own server listens on every interface."""
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bind, port))
        sock.listen(4096)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    fd = sock.detach()  # the store owns the descriptor from here (it closes it)
    try:
        return dist.TCPStore(bind, port, world_size, True, datetime.timedelta(seconds=timeout),
                             wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise
