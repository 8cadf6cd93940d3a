"""Keep freed memory in the worker process instead of handing it back to the kernel.

A training step allocates and frees the same large tensors every iteration (gradients,
activations, autograd temporaries). glibc's malloc serves blocks above its mmap threshold
with fresh ``mmap`` calls and trims the top of its heap on ``free``; either way the
next iteration touches brand-new pages, and every 4 KiB page costs a page fault plus the
kernel zeroing it. For ResNet-18 (45 MB of gradients) that was 4,000 to 17,000 faults
per iteration and about 18% of a no-communication iteration on this machine (measured
with ``shmtrain bench overlap --workers 1``, see ``docs/overlap.md``).

:func:`keep_freed_memory` raises both thresholds once per process, so freed blocks stay
in the heap and are reused: the process's peak memory is unchanged, it is just not
returned between iterations. Every worker started by the launcher calls it (before the
first tensor), and so does :class:`shmtrain.parallel.data_parallel.DataParallel`; set
``SHMTRAIN_KEEP_FREED_MEMORY=0`` to leave malloc's defaults.
"""

from __future__ import annotations

import ctypes
import os

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: glibc's upper limit for M_MMAP_THRESHOLD on 64-bit (larger values are refused)
MMAP_THRESHOLD = 32 * 1024 * 1024
#: free heap top kept before trimming (the process keeps up to this much idle memory)
TRIM_THRESHOLD = 1 << 30

_done = False


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (once per process); True if applied.

    No-op (False) when ``SHMTRAIN_KEEP_FREED_MEMORY=0`` or the C library has no
    ``mallopt`` (not glibc).
    """
    global _done
    if _done:
        return True
    if os.environ.get("SHMTRAIN_KEEP_FREED_MEMORY", "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    _done = ok
    return ok
