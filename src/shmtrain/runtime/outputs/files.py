"""Writing a run's files so that a crash or a full disk never leaves half a file.

Every output of a run (``config.toml``, ``summary.json``, ``model.pt``, ``plot.png``,
``trace.json``, the checkpoints) is written under a temporary name in the same folder,
fsynced, and renamed over the old one: a reader sees the previous file or the new one,
never a part. A write that fails (typically a full disk) raises :class:`OutputError`,
which names the path, the space the file needs and the space that is free, and leaves
the previous file intact and no temporary file behind.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO


class OutputError(RuntimeError):
    """A run's output file could not be written; the message names it and the fix."""


def fsync_dir(path: Path) -> None:
    """Make the entries of folder ``path`` (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically(path: Path, fill: Callable[[BinaryIO], Any], *, tmp: Path | None = None) -> Any:
    """Write ``path`` so that a reader sees the old file or the new one, never a part:
    ``fill`` writes into a temporary name, which is fsynced and renamed; returns what
    ``fill`` returned."""
    tmp = tmp or path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            result = fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return result


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically, then fsync the folder (the rename is durable)."""
    replace_atomically(path, lambda f: f.write(data))
    fsync_dir(path.parent)


class LineLog:
    """A file of whole lines, appended with one ``write`` per line on an ``O_APPEND``
    descriptor: a reader, a kill or another writer never sees part of a line (a text
    file's buffer would flush wherever it fills). The part of :class:`typing.TextIO` the
    training loop uses: ``write``, ``flush``, ``close``."""

    def __init__(self, path: Path, *, truncate: bool = False) -> None:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | (os.O_TRUNC if truncate else 0)
        self.path = path
        self._fd: int | None = os.open(path, flags, 0o644)
        self._pending = ""

    def write(self, text: str) -> int:
        """Append ``text``'s complete lines now (a trailing part waits for its newline)."""
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        self._pending += text
        if "\n" in self._pending:
            cut = self._pending.rindex("\n") + 1
            lines, self._pending = self._pending[:cut], self._pending[cut:]
            for line in lines.splitlines(keepends=True):
                data = line.encode()
                while data:  # a short write (a signal) must not split the line's bytes apart
                    data = data[os.write(self._fd, data):]
        return len(text)

    def flush(self) -> None:
        """Lines are written as they complete; nothing is held but an unfinished one."""

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1_000_000 else f"{n / 1e3:.1f} kB"


def space_note(path: Path, needed: int) -> str:
    """``"it needs 12.3 MB; 0.8 MB are free there"`` (what is known of the two)."""
    try:
        free = shutil.disk_usage(path.parent if path.parent.exists() else Path.cwd()).free
    except OSError:
        return f"it needs {megabytes(needed)}"
    return f"it needs {megabytes(needed)}; {megabytes(free)} are free there"


def cannot_write(path: Path, exc: OSError, needed: int | None) -> str:
    """The one-line reason a write of ``path`` failed, with the space when that is why."""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT) and needed is not None:
        reason = f"{reason} ({space_note(path, needed)})"
    return f"cannot write {path}: {reason}"


def write_output(path: Path, data: bytes) -> None:
    """Write one output file atomically; :class:`OutputError` (path, space needed and
    free, the previous file intact) when it cannot be written."""
    existed = path.exists()
    try:
        write_atomic(path, data)
    except OSError as exc:
        kept = f"the previous {path.name} is intact" if existed else "nothing was left half-written"
        raise OutputError(f"{cannot_write(path, exc, len(data))}; {kept}; free space there or "
                          "give another --out") from None


def save_output(path: Path, obj: Any) -> None:
    """``torch.save`` ``obj`` to ``path`` through :func:`write_output` (serialized in
    memory first, so the space it needs is known)."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_output(path, buffer.getvalue())


def figure_output(path: Path, fig: Any, **savefig: Any) -> None:
    """Save a matplotlib figure through :func:`write_output` (PNG)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", **savefig)
    write_output(path, buffer.getvalue())
