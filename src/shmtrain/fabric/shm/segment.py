"""Named POSIX shared-memory segments as zero-copy torch tensors.

Every name starts with ``shmtrain`` so a leak can be found with ``ls /dev/shm``.
Segments are created mode 0600 (owner only), and one is attached by name only if this
user owns it and no one else can open it (checked on the open descriptor: a name that
another user made first, or a world-writable file, is refused, whoever announced it). The lifecycle that keeps them from
outliving a run is: the creator makes the name, every peer attaches (maps it), then the
creator unlinks the name at once; the mappings stay valid until each process exits, so
nothing is left in /dev/shm whatever way a process ends after set-up (normal end,
exception, Ctrl-C, SIGKILL). A host's collective segments (``fabric/shm/host.py``) close
the set-up window too: their name is unlinked right after it is made (``named=False``)
and the peers open the creator's descriptor (:func:`open_descriptor`), so a SIGKILL while
the creator waits for its peers leaves nothing. :func:`sweep` removes a run's names left
by a failure during the set-up of the others.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch

from shmtrain.fabric.trust import check_fd

SHM_DIR = Path("/dev/shm")
PREFIX = "shmtrain"
ALIGN = 64


def align(nbytes: int, to: int = ALIGN) -> int:
    """Round ``nbytes`` up to a multiple of ``to`` (a cache line by default)."""
    return (nbytes + to - 1) // to * to


class SharedSegment:
    """One named shared-memory segment mapped into this process.

    Args:
        name: segment name; must start with ``shmtrain``.
        nbytes: size in bytes (> 0).
        create: create it (mode 0600, fails if it exists) or attach to an existing one.
        fd: attach through this inherited descriptor instead of the name (which may
            already be unlinked); the segment takes ownership of it.
        named: with ``create``, False unlinks the name right after it is made, before
            the segment is sized or mapped (peers then open it through the creator's
            descriptor, :func:`open_descriptor`): nothing of it can outlive the processes
            that map it, whenever they are killed.
    """

    def __init__(self, name: str, nbytes: int, *, create: bool, fd: int | None = None,
                 named: bool = True) -> None:
        if not name.startswith(PREFIX) or "/" in name:
            raise ValueError(f"segment name {name!r} must start with {PREFIX!r} and hold no '/'")
        if nbytes <= 0:
            raise ValueError(f"segment {name!r}: size must be positive, got {nbytes}")
        self.name = name
        self.nbytes = nbytes
        self.created = create
        path = SHM_DIR / name
        if fd is not None:
            if os.fstat(fd).st_size < nbytes:
                raise ValueError(f"segment {name!r} (fd {fd}) is smaller than {nbytes} bytes")
        elif create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            if not named:
                path.unlink(missing_ok=True)
            try:
                os.ftruncate(fd, nbytes)
            except BaseException:
                os.close(fd)
                path.unlink(missing_ok=True)
                raise
        else:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            try:
                check_fd(fd, f"shared-memory segment {str(path)!r}",
                         "shmtrain attaches only its own segments (another user's, or one anyone can open, "
                         "could read or change this run's tensors); remove it if it is a leftover", private=True)
            except BaseException:
                os.close(fd)
                raise
            size = os.fstat(fd).st_size
            if size < nbytes:
                os.close(fd)
                raise ValueError(f"segment {name!r} holds {size} bytes, {nbytes} expected")
        try:
            self.buffer = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd  # kept open: stitched views map pieces of the segment again
        self._unlinked = create and not named

    def tensor(self, dtype: torch.dtype, offset: int, numel: int) -> torch.Tensor:
        """A zero-copy tensor over ``numel`` elements starting at byte ``offset``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset % itemsize or offset < 0 or offset + numel * itemsize > self.nbytes:
            raise ValueError(
                f"segment {self.name!r}: view [{offset}, +{numel}x{itemsize}) does not fit "
                f"its {self.nbytes} bytes or is misaligned"
            )
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self.buffer, dtype=dtype, count=numel, offset=offset)

    def address(self, offset: int = 0) -> int:
        """Virtual address of byte ``offset`` in this process (for futex words)."""
        import ctypes

        return ctypes.addressof(ctypes.c_char.from_buffer(self.buffer, offset))

    def unlink(self) -> None:
        """Remove the name from /dev/shm; mappings stay valid until process exit."""
        if not self._unlinked:
            (SHM_DIR / self.name).unlink(missing_ok=True)
            self._unlinked = True


    def close(self) -> None:
        """Close the descriptor (mappings and views stay valid)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def open_descriptor(pid: int, fd: int, what: str) -> int:
    """A descriptor of the file that process ``pid`` (a peer of this host, this user's) has
    open at ``fd`` (``/proc/<pid>/fd/<fd>``: a segment whose name is already unlinked),
    refused unless this user alone can open that file.

    Raises:
        UntrustedError: the file is another user's, or others may open it.
        OSError: the process or its descriptor is gone (it ended during set-up).
    """
    own = os.open(f"/proc/{int(pid)}/fd/{int(fd)}", os.O_RDWR)
    try:
        check_fd(own, what, "shmtrain attaches only its own segments (another user's, or one anyone can "
                 "open, could read or change this run's tensors)", private=True)
    except BaseException:
        os.close(own)
        raise
    return own


def sweep(prefix: str) -> list[str]:
    """Remove every segment whose name starts with ``prefix``; return the removed names."""
    if not prefix.startswith(PREFIX):
        raise ValueError(f"refusing to sweep {prefix!r}: not a shmtrain prefix")
    removed = []
    try:
        entries = list(SHM_DIR.iterdir())
    except FileNotFoundError:
        return removed
    for entry in entries:
        if entry.name.startswith(prefix):
            try:
                entry.unlink()
                removed.append(entry.name)
            except FileNotFoundError:
                pass
    return removed


def leftover(prefix: str = PREFIX) -> list[str]:
    """Names in /dev/shm that start with ``prefix`` (for leak checks)."""
    try:
        return sorted(e.name for e in SHM_DIR.iterdir() if e.name.startswith(prefix))
    except FileNotFoundError:
        return []
