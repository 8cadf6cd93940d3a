"""Where a worker's start-up goes: timestamped marks in its log (``SHMTRAIN_STARTUP_LOG=1``).

With the variable set (``shmtrain bench hosts`` sets it), a worker writes one line to
stderr at each step of its start-up::

    shmtrain-startup rank=2 t=1795590051.160 process

``t`` is seconds since the epoch; the first line (``process``) is when the kernel
started the process (``/proc/self/stat``, so the interpreter's own start is counted),
then ``imports`` (the command line parsed, shmtrain's and torch's modules loaded),
``store`` (torchrun's TCP store reached), ``host`` (the host's shared-memory group
joined), ``gloo`` (the job's gloo groups made), ``joined`` (the run folder agreed),
``data``, ``model``, ``strategy`` (DataParallel built: the memory server for the
asynchronous methods) and ``first-iteration``. ``shmtrain.bench.hosts.rows`` reads
them back from the job's logs (:func:`read_marks`) into a row's ``startup_phases_s``.
Nothing is written, and nothing costs, without the variable.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

ENV = "SHMTRAIN_STARTUP_LOG"
_LINE = re.compile(r"shmtrain-startup rank=(\d+) t=([\d.]+) (\S+)")
_started = False


def _process_start() -> float | None:
    """When the kernel started this process, in seconds since the epoch (Linux), or None.

    The start is counted back from now by the process's age (``/proc/uptime`` less its
    start in clock ticks after boot), not added to ``/proc/stat``'s ``btime``: that is
    whole seconds, and made the ``process`` mark up to a second early."""
    try:
        now = time.time()
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime: clock ticks after boot (field 22 of proc(5))
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return now - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def mark(phase: str) -> None:
    """Write ``phase``'s line now (the first call writes ``process`` before it)."""
    global _started
    if not os.environ.get(ENV):
        return
    rank = os.environ.get("RANK", "0")
    if not _started:
        _started = True
        start = _process_start()
        if start is not None:
            print(f"shmtrain-startup rank={rank} t={start:.3f} process", file=sys.stderr, flush=True)
    print(f"shmtrain-startup rank={rank} t={time.time():.3f} {phase}", file=sys.stderr, flush=True)


def read_marks(logs: list[Path]) -> dict[int, dict[str, float]]:
    """rank -> phase -> time, from the lines of :func:`mark` in ``logs`` (torchrun's
    per-host output, where every local worker's stderr lands, possibly prefixed)."""
    marks: dict[int, dict[str, float]] = {}
    for log in logs:
        if log.is_file():
            for match in _LINE.finditer(log.read_text(errors="replace")):
                marks.setdefault(int(match[1]), {}).setdefault(match[3], float(match[2]))
    return marks
