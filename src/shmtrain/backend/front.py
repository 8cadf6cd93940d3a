"""The ``shm`` backend's front in C++: a small allreduce without entering Python.

A c10d backend written in Python pays for Python on every call: torch's dispatch into it,
its method, its ``Work``. For a 4 KiB allreduce that was most of the call (``shmtrain bench
floors``: torch's dispatch into a C++ backend costs a few microseconds, into this Python one
several times more, and the backend's own Python as much again, around a hand-off of a few
microseconds). Small messages are where the latency term dominates (Thakur, Rabenseifner and
Gropp, "Optimization of Collective Communication Operations in MPICH", 2005, section 2:
``alpha`` against ``n * beta``), so that is where the front works.

:class:`Front` (``front.cpp``) is the c10d ``Backend`` torch dispatches to. A float32 SUM
or AVG allreduce of one contiguous CPU tensor that fits the call ring's payload, a barrier,
and a broadcast or an ``all_gather_into_tensor`` of such a tensor (any dtype the backend
moves) are the call ring's one hand-off (``shm_call`` of the compiled library, through the Python backend's own
plan and progress record, so both paths number the calls alike and either may follow the
other), and returns a finished ``Work``. Every other call goes to the Python backend (the
``inner``) through its c10d methods, as torch would have called them; so does the rest of a
fast call whose wait outlasted its slice or met an abort or a mismatch, where the Python
path judges peers, timeouts and failures as for any call.

The front is built on first use, like the C library (:mod:`shmtrain.fabric.native`), with
torch's extension builder into a folder of this user's cache (0700, checked for owner
before its module is imported); where it cannot be built, or ``SHMTRAIN_PG_FRONT=0``, the
Python backend is the backend, as before. Every rank of a host may take either: the wire is
the same.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from shmtrain.backend import calls
from shmtrain.backend.reduce_ops import KIND_CODE, MOVED
from shmtrain.backend.work import ShmBackendError
from shmtrain.fabric import native

SOURCE = Path(__file__).with_name("front.cpp")
FAILED = "build-failed"  # in the build folder: why the build failed, so no later process retries it

_module: Any = None
_tried = False
_lock = threading.Lock()
why_not = ""  # why module() is None


def module() -> Any:
    """The compiled front, built on first use; None where it cannot be had (:data:`why_not`)."""
    global _module, _tried, why_not
    with _lock:
        if _tried:
            return _module
        _tried = True
        if os.environ.get("SHMTRAIN_PG_FRONT", "1") == "0":
            why_not = "SHMTRAIN_PG_FRONT=0"
            return None
        if native.library() is None:
            why_not = f"no compiled library ({native.why_not})"
            return None
        failed = folder() / FAILED
        if failed.is_file() and native.private(failed):  # an earlier process's build failed: not again
            why_not = failed.read_text()[:400]
            return None
        try:
            _module = _build()
        except Exception as exc:  # noqa: BLE001 - no compiler, no headers: the Python backend serves
            text = str(exc).strip().splitlines() or [type(exc).__name__]
            why_not = f"cannot build or load the C++ front: {text[-1][:300]}"
            if not isinstance(exc, ShmBackendError):  # remembered, so that every later process does not retry
                with contextlib.suppress(OSError):
                    failed.write_text(why_not + f" (remove {failed} to try again)")
        return _module


def folder() -> Path:
    """Where the front is built: a folder of the cache keyed by its source, torch and Python."""
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + sys.version.encode()).hexdigest()[:16]
    return native.cache_dir() / f"pg_front-{key}"


def _build() -> Any:
    where = folder()
    key = where.name.split("-", 1)[1]
    where.parent.mkdir(parents=True, exist_ok=True)
    try:
        where.mkdir(mode=0o700)
    except FileExistsError:
        pass
    for path in (where.parent, where):  # its module's code runs here: no one else may have put it there
        if not native.private(path) or not path.is_dir():
            raise ShmBackendError(f"{path} is not a folder of this user's that others cannot write; remove it, or "
                                  "set SHMTRAIN_CACHE to a folder of your own")
    built = where / f"shmtrain_pg_front_{key}.so"
    name = f"shmtrain_pg_front_{key}"
    # one build at a time, held by a lock the kernel drops with its holder (torch's own lock
    # file outlives a build that was killed, and its next build would wait for it forever)
    fd = os.open(where / "build.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if not built.exists():
            print(f"shmtrain: building the shm backend's C++ front once ({where}; about a minute)", file=sys.stderr,
                  flush=True)
            (where / "lock").unlink(missing_ok=True)  # torch's, of a build that did not finish
            logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime": none needed
            from torch.utils import cpp_extension

            return cpp_extension.load(name, [str(SOURCE)], build_directory=str(where), extra_cflags=["-O2"],
                                      verbose=False)
    finally:
        os.close(fd)
    if not native.private(built):
        raise ShmBackendError(f"{built} is not this user's or others can write it; remove it")
    spec = importlib.util.spec_from_file_location(name, built)  # as it is: torch's builder would re-check it
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def wrap(backend: Any) -> Any:
    """``backend`` (a :class:`~shmtrain.backend.group.ShmBackend`) behind its front, or
    ``backend`` itself where the front cannot serve it (several hosts, no compiled
    library, no front)."""
    if os.environ.get("SHMTRAIN_PG_FRONT", "1") == "0":
        return backend
    reducer = backend.reducer
    handles = reducer.calls_ring.handles()
    if reducer.hosts != 1 or handles is None:
        return backend
    ext = module()
    if ext is None:
        return backend
    ring = reducer.calls_ring
    dtypes = [torch.empty(0, dtype=dtype) for dtype in MOVED]  # a dtype's header code is its index
    kinds = [KIND_CODE[kind] for kind in ("SUM", "AVG", "barrier", "broadcast", "all_gather")]
    front = ext.Front(backend, backend.rank(), backend.size(), *handles, *ring.geometry(), reducer.carried,
                      calls.wait_mode(reducer.host.control, None), dtypes, kinds, calls.SLICE, backend.count_fast)
    reducer.attach(front.gate())
    return front


__all__ = ["SOURCE", "folder", "module", "why_not", "wrap"]
