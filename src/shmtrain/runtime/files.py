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
    file's buffer would flush wherever it fills), and a full disk never leaves one: the
    file is cut back to the line's start (one writer per file: a rank's metrics). The part of :class:`typing.TextIO` the
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
                self._append(line.encode())
        return len(text)

    def _append(self, data: bytes) -> None:
        """One whole line, or none: a write that fails part-way (a full disk) is cut back
        to where the line began, and :class:`OutputError` names the file and the space."""
        assert self._fd is not None
        start = os.lseek(self._fd, 0, os.SEEK_END)
        left = data
        try:
            while left:  # a short write (a signal) must not split the line's bytes apart
                left = left[os.write(self._fd, left):]
        except OSError as exc:
            try:
                os.ftruncate(self._fd, start)  # shrinking a file needs no free space
            except OSError:
                pass
            raise OutputError(f"{cannot_write(self.path, exc, len(data))}; the row was not written "
                              "(the rows before it are whole); free space there or give another --out") from None

    def flush(self) -> None:
        """Lines are written as they complete; nothing is held but an unfinished one."""

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1_000_000 else f"{n / 1e3:.1f} kB"


def space_note(path: Path, needed: int) -> str:
    """``"it needs 12.3 MB; 0.8 MB are free there"`` (what is known of the two); when more is
    free by now than it needed, what took the space."""
    try:
        free = shutil.disk_usage(path.parent if path.parent.exists() else Path.cwd()).free
    except OSError:
        return f"it needs {megabytes(needed)}"
    if free < needed:
        return f"it needs {megabytes(needed)}; {megabytes(free)} are free there"
    # more is free now than it needed: the space went to writes at the same moment (other
    # ranks' files), freed since they failed too; the figure alone would read as room
    return (f"it needs {megabytes(needed)}, more than was free when it was written; {megabytes(free)} are "
            "free there now that the failed writes are gone (other ranks write at the same time: "
            "leave room for all of them)")


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
