"""The compiled hot paths: build ``pipeline_native.c`` (with ``pipeline_wait.h``),
``call_native.c`` (the ``shm`` backend's call hand-off), ``ring_native.c`` (the blocks of
its other collectives) and ``compress_native.c`` into one library once per machine, load it
with ctypes.

The private-tensor allreduce's per-block work (copy in, post, wait, sum) costs ~20-35 us
per call from Python, several times MPICH's compiled path on small messages.
The same algorithm in C costs a few microseconds. It is a plain shared library,
not a Python extension: no build step at install time, no Python ABI; the machine's C
compiler (``$CC``, else ``cc``) builds it on first use into a cache folder keyed by the
source's hash, the flags and the machine, and every later process only loads it (if
this user owns it and nobody else may write it). Building goes to a
temporary name renamed into place, so concurrent first uses are safe.

Where there is no compiler, the build fails or ``SHMTRAIN_NATIVE=0`` is set,
:func:`library` returns None and the Python path runs (same results). ctypes releases
the GIL for the call, so a thread waiting inside it does not block the others.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("pipeline_native.c")
HEADER = SOURCE.with_name("pipeline_wait.h")  # included by SOURCE: part of the cache key
#: compiled into the same library (the backend's call hand-off and ring, the compressed exchange's encoder)
SOURCES = (SOURCE, SOURCE.with_name("call_native.c"), SOURCE.with_name("ring_native.c"),
           SOURCE.with_name("compress_native.c"))
MAXL = 64  # local ranks a plan holds (MAXL in the C source)
# -march=native (5-10% here: 4 KiB 3.2 vs 3.4 us, 16 MiB 2.02 vs 2.13 ms between 2
# processes); the CPU's whole feature list is part of the cache key, so a cache folder
# shared between machines never hands one of them instructions its CPU lacks
# -ffp-contract=off: no fused multiply-adds, so the C arithmetic rounds as torch's separate
# operations do (the compressed exchange's error feedback equals the torch path's bit for bit)
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-pthread"]

_library: ctypes.CDLL | None = None
_tried = False
_lock = threading.Lock()
why_not = ""  # why library() is None, for messages and benchmarks


class Plan(ctypes.Structure):
    """``struct plan`` of the C source."""

    _fields_ = [
        ("ring", ctypes.c_void_p),
        ("results", ctypes.c_void_p),
        ("ctrl", ctypes.c_void_p),
        ("announce", ctypes.c_void_p),
        ("done", ctypes.c_void_p),
        ("per", ctypes.c_int64),
        ("posted", ctypes.c_int32 * MAXL),
        ("reduced", ctypes.c_int32 * MAXL),
        ("sleepers", ctypes.c_int32 * MAXL),
        ("L", ctypes.c_int32),
        ("me", ctypes.c_int32),
        ("mode", ctypes.c_int32),
        ("spin_ns", ctypes.c_int32),
        ("yields", ctypes.c_int32),
        ("partials", ctypes.c_void_p),
        ("S", ctypes.c_int32),
        ("G", ctypes.c_int32),
        ("gindex", ctypes.c_int32),
        ("group", ctypes.c_int32),
        ("members", ctypes.c_int32 * MAXL),
        ("all", ctypes.c_int32 * MAXL),
    ]


class Progress(ctypes.Structure):
    """``struct progress``: where a call stopped, so the next one resumes there."""

    _fields_ = [
        ("pos", ctypes.c_int64),
        ("seq", ctypes.c_int64),
        ("phase", ctypes.c_int32),
        ("waiting", ctypes.c_int32),
        ("wakes", ctypes.c_int32),
    ]


def cache_dir() -> Path:
    """``$SHMTRAIN_CACHE``, else ``$XDG_CACHE_HOME/shmtrain``, else ``~/.cache/shmtrain``."""
    explicit = os.environ.get("SHMTRAIN_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shmtrain"


def features() -> str:
    """The machine and every feature flag its CPU reports (x86 "flags", Arm "Features")."""
    lines = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name", "CPU part")) and line not in lines:
                    lines.append(line)
                if line.strip() == "" and lines:  # the first processor is enough
                    break
    except OSError:
        pass
    return platform.machine() + "".join(lines)


def private(path: Path) -> bool:
    """Whether ``path`` (not followed if a link) is this user's and no one else may write it:
    the rule for what this process loads and runs (this library, the backend's C++ front)."""
    info = path.lstat()
    return info.st_uid == os.geteuid() and not info.st_mode & 0o022


def _build(target: Path) -> str:
    """Compile the sources to ``target``; returns "" or why it failed."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return "no C compiler (cc, gcc or $CC) on PATH"
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *_FLAGS, "-shared", "-fPIC", "-o", tmp, *map(str, SOURCES)],
                              capture_output=True, text=True, timeout=120)
        if done.returncode == 0:
            os.replace(tmp, target)
            return ""
        error = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1][:200]
    except (OSError, subprocess.SubprocessError) as exc:
        error = str(exc)[:200]
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return f"{compiler} failed: {error}"


def library() -> ctypes.CDLL | None:
    """The loaded library, building it on first use; None where it cannot be had
    (:data:`why_not` says why)."""
    with _lock:  # a second thread waits for the first one's build instead of seeing None
        return _load()


def _load() -> ctypes.CDLL | None:
    global _library, _tried, why_not
    if _tried:
        return _library
    _tried = True
    if os.environ.get("SHMTRAIN_NATIVE", "1") == "0":
        why_not = "SHMTRAIN_NATIVE=0"
        return None
    if not sys.platform.startswith("linux"):
        why_not = f"futex waits need Linux, this is {sys.platform}"
        return None
    source = b"".join(path.read_bytes() for path in (*SOURCES, HEADER))
    key = hashlib.sha256(source + repr(_FLAGS).encode() + features().encode()).hexdigest()[:16]
    target = cache_dir() / f"pipeline_native-{key}.so"
    try:
        if not target.exists():
            why_not = _build(target)
            if why_not:
                return None
        for path in (target.parent, target):  # loading it runs its code: no one else may have put it there
            if not private(path):
                why_not = (f"{path} is not owned by this user or is writable by others; remove it, or set "
                           "SHMTRAIN_CACHE to a folder of your own")
                return None
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        why_not = f"cannot build or load {target}: {exc}"
        return None
    lib.shm_pipeline_f32.argtypes = [ctypes.POINTER(Plan), ctypes.POINTER(Progress), ctypes.c_void_p,
                                     ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_double]
    lib.shm_pipeline_f32.restype = ctypes.c_int
    lib.shm_call.argtypes = [ctypes.POINTER(Plan), ctypes.POINTER(Progress), ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double]
    lib.shm_call.restype = ctypes.c_int
    lib.shm_ring_collect.argtypes = [ctypes.POINTER(Plan), ctypes.POINTER(Progress), ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_int64, ctypes.c_int64, ctypes.c_double]
    lib.shm_ring_collect.restype = ctypes.c_int
    lib.shm_ring_reduce_f32.argtypes = [ctypes.POINTER(Plan), ctypes.POINTER(Progress), ctypes.c_void_p,
                                        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                        ctypes.c_int64, ctypes.c_double]
    lib.shm_ring_reduce_f32.restype = ctypes.c_int
    lib.shm_ring_exchange.argtypes = [ctypes.POINTER(Plan), ctypes.POINTER(Progress), ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_double]
    lib.shm_ring_exchange.restype = ctypes.c_int
    lib.shm_sum_into_f32.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float]
    lib.shm_sum_into_f32.restype = None
    lib.shm_handoff_s.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.shm_handoff_s.restype = ctypes.c_double
    lib.shm_topk_encode_f32.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64,
                                        ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int, ctypes.c_void_p]
    lib.shm_topk_encode_f32.restype = None
    lib.shm_topk_scratch_bytes.argtypes = []
    lib.shm_topk_scratch_bytes.restype = ctypes.c_int64
    _library = lib
    return lib


def sum_into(own: torch.Tensor, peers: list[torch.Tensor], factor: float = 1.0) -> bool:
    """``own += peers[0] + peers[1] + ...`` then ``own *= factor``, in one pass over memory
    (``shm_sum_into_f32``: every peer added to a 16 KiB block of ``own`` while it is in L1),
    for contiguous float32 CPU tensors of equal length. Returns False, touching nothing,
    where the library is not available or the tensors are not float32 (the caller then
    takes its torch path)."""
    lib = library()
    if lib is None or own.dtype != torch.float32:
        return False
    pointers = (ctypes.c_void_p * len(peers))(*(p.data_ptr() for p in peers))
    lib.shm_sum_into_f32(own.data_ptr(), pointers, len(peers), own.numel(), factor)
    return True
