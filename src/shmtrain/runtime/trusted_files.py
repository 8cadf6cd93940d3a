"""What a command reads from a run folder or a config file, checked first: whose it is.

A run folder's ``config.toml`` and a ``--config`` file name code: ``--model``, ``--data``
and ``--task`` take ``module:callable``, imported and called; its checkpoints and model
files are loaded. So a run folder, and every file read from one or given as ``--config``,
is used only when it is trusted, as git uses a repository only when it is the user's
own (``safe.directory``): it is trusted when this user (or root, who can change this
user's files anyway) owns it and not every user can write it, or when it lies at or
under a path listed in ``SHMTRAIN_TRUSTED`` (paths separated by ``:``; ``*`` trusts
every path), the way to accept a colleague's run folder. Anything else is refused with
one line (:class:`~shmtrain.fabric.trust.UntrustedError`, a ValueError) naming the path,
its owner or mode, and the fix.

Files are checked on the descriptor that is then read (:func:`read_bytes`,
:func:`open_file`): no one can swap the file between the check and the use. Every
command that reads a run folder or a config goes through :func:`check`: ``train
--config``, ``train --resume`` (and a restart, and a torchrun job that resumes its
``--out``), ``evaluate`` and ``compare``. The checks are made at start-up, never per
iteration.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from shmtrain.fabric.trust import UntrustedError, untrusted

#: the environment variable that lists trusted paths (``:``-separated; ``*``: every path)
TRUSTED_ENV = "SHMTRAIN_TRUSTED"


def listed(path: str | os.PathLike) -> bool:
    """Whether ``path`` (its real path) is at or under a path :data:`TRUSTED_ENV` lists."""
    entries = [e for e in os.environ.get(TRUSTED_ENV, "").split(os.pathsep) if e]
    if "*" in entries:
        return True
    real = Path(os.path.realpath(path))
    return any(real == (top := Path(os.path.realpath(e))) or top in real.parents for e in entries)


def why_untrusted(st: os.stat_result) -> str | None:
    """Why a file or folder of status ``st`` is not this user's to trust, or None (root's
    are trusted when not every user can write them)."""
    if st.st_uid == 0 and not stat.S_IMODE(st.st_mode) & 0o002:
        return None
    return untrusted(st)


def check(fd: int, path: str | os.PathLike, what: str) -> None:
    """Raise :class:`UntrustedError` unless the file or folder open at ``fd`` (opened as
    ``path``; ``what`` names it, e.g. ``--config``) is trusted (module docstring)."""
    why = why_untrusted(os.fstat(fd))
    if why and not listed(path):
        raise UntrustedError(
            f"{what} {path} {why}; refused, since shmtrain imports and calls the module:callable values a "
            f"config names and loads a run's checkpoints: if you trust it, list it in {TRUSTED_ENV} (e.g. "
            f"{TRUSTED_ENV}={os.path.abspath(path)} shmtrain ...)")


def check_folder(path: str | os.PathLike, what: str = "run folder") -> None:
    """:func:`check` of the folder ``path`` (opened, so a link is judged by its target)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        check(fd, path, what)
    finally:
        os.close(fd)


def open_file(path: str | os.PathLike, what: str) -> BinaryIO:
    """``path`` open for reading, after :func:`check` of that open file."""
    f = open(path, "rb")  # noqa: SIM115 - returned to the caller, who closes it
    try:
        check(f.fileno(), path, what)
    except BaseException:
        f.close()
        raise
    return f


def read_bytes(path: str | os.PathLike, what: str) -> bytes:
    """The bytes of ``path``, read from the descriptor :func:`check` accepted."""
    with open_file(path, what) as f:
        return f.read()
