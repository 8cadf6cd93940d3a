"""Where workers compute: ``--device cpu|cuda|cuda:N|auto``.

The launcher checks the value (:func:`resolve_device`) before any worker starts, and
imports torch for that only when a GPU is asked for; each worker then picks its device
(:func:`worker_device`): ``cuda`` puts local rank ``r`` on GPU ``r % device_count``,
``cuda:N`` puts every worker on GPU N (workers may share a GPU: the strategies stage
through host memory, ``strategies/layout/staging.py``), and ``auto`` is ``cuda`` where a GPU is
present, else ``cpu``. The buffers the strategies share stay in host memory either way.
"""

from __future__ import annotations

import torch

#: the values of ``--device`` besides ``cuda:N``
DEVICES = ("cpu", "cuda", "auto")


def cuda_count() -> int:
    """The CUDA devices this process sees (0 without a GPU or a driver)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(value: str) -> str:
    """Check ``--device`` (launcher side); return it unchanged (``auto`` stays ``auto``:
    each worker resolves it). ValueError naming the option, what was found and the fix."""
    if value in ("cpu", "auto"):
        return value
    if value == "cuda" or value.startswith("cuda:"):
        index = value.partition(":")[2]
        if index and not index.isdigit():
            raise ValueError(f"--device {value!r}: the GPU index must be a number, e.g. --device cuda:0")
        found = cuda_count()
        if not found:
            raise ValueError(f"--device {value!r}: this machine has no CUDA device (torch "
                             f"{torch.__version__}, CUDA {torch.version.cuda or 'not built in'}); use "
                             "--device cpu, or auto (the GPU when there is one)")
        if index and int(index) >= found:
            raise ValueError(f"--device {value!r}: there are {found} CUDA device(s) here, numbered 0 "
                             f"to {found - 1}; use --device cuda:{found - 1} or lower, or --device cuda "
                             "(worker r on GPU r mod the count)")
        return value
    raise ValueError(f"--device {value!r} is not a device; choose cpu, cuda, cuda:N or auto")


def worker_device(value: str, local_rank: int) -> torch.device:
    """The device of the worker of ``local_rank`` for ``--device value`` (worker side;
    makes a GPU the worker's current device)."""
    if value == "cpu" or (value == "auto" and not cuda_count()):
        return torch.device("cpu")
    count = cuda_count()
    if not count:
        raise ValueError(f"--device {value!r}: this worker sees no CUDA device; use --device cpu")
    index = value.partition(":")[2]
    device = torch.device("cuda", int(index) if index else local_rank % count)
    torch.cuda.set_device(device)
    return device
