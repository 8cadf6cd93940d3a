"""Sleep until a 32-bit word in shared memory changes: Linux futex through ctypes.

Waiting peers must not spin a core (2 cores, 4 workers here). ``futex_wait`` sleeps
in the kernel until a ``futex_wake`` on the same physical word, or the timeout. The
call goes through ctypes, which releases the GIL, so a waiting update thread does not
block the training thread. Where the futex syscall number is unknown, waits fall back
to short sleeps.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "ppc64le": 221}.get(platform.machine())
_FUTEX_WAIT = 0  # shared (not PRIVATE): the word lives in memory mapped by many processes
_FUTEX_WAKE = 1
_INT_MAX = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True) if _SYS_FUTEX is not None else None
AVAILABLE = _libc is not None and os.name == "posix"


def _as_int32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= (1 << 31) else value


def futex_wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the int32 at ``address`` equals ``expected``, at most ``timeout_s``.

    Returns on wake-up, on timeout, when the value already differs, or on a signal;
    the caller re-reads the word and decides.
    """
    if not AVAILABLE:
        time.sleep(min(timeout_s, 0.0005))
        return
    seconds = max(timeout_s, 0.0)
    ts = _Timespec(int(seconds), int((seconds - int(seconds)) * 1e9))
    _libc.syscall(
        ctypes.c_long(_SYS_FUTEX),
        ctypes.c_void_p(address),
        ctypes.c_int(_FUTEX_WAIT),
        ctypes.c_int(_as_int32(expected)),
        ctypes.byref(ts),
        ctypes.c_void_p(0),
        ctypes.c_int(0),
    )


def futex_wake(address: int, count: int = _INT_MAX) -> None:
    """Wake up to ``count`` processes sleeping on the word at ``address``."""
    if not AVAILABLE:
        return
    _libc.syscall(
        ctypes.c_long(_SYS_FUTEX),
        ctypes.c_void_p(address),
        ctypes.c_int(_FUTEX_WAKE),
        ctypes.c_int(count),
        ctypes.c_void_p(0),
        ctypes.c_void_p(0),
        ctypes.c_int(0),
    )
