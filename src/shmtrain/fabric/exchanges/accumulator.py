"""TRL's shared gradient accumulator: two alternating sums and a critical counter per layer.

TRL (Algorithm 5, line 3; Algorithm 7) accumulates every worker's gradient of a layer
into one host buffer ``g_grads`` under a per-layer critical section ``Critical``, whose
counter also tells how many workers have added their share. :class:`SharedAccumulator`
is that state in one host segment: a page of :class:`CriticalCounters`, then two flat
sums (alternating by iteration parity, so iteration k+1's accumulation never waits for
iteration k's readers). Built by :meth:`shmtrain.fabric.transports.Transports.accumulator`.
"""

from __future__ import annotations

import torch

from shmtrain.fabric.exchanges.critical import CriticalCounters
from shmtrain.fabric.shm.host import HostGroup
from shmtrain.fabric.shm.segment import align
from shmtrain.fabric.shm.stitch import PAGE


class SharedAccumulator:
    """The host's gradient sums and their critical counters (collective on the host).

    Attributes:
        critical: the per-layer counters (``acquire``/``release``/``wait_count``).
        sums: the two flat sums, ``numel`` elements of ``dtype`` each.
    """

    def __init__(self, host: HostGroup, numel: int, dtype: torch.dtype, layers: int, *, tag: str = "cpu_acc") -> None:
        itemsize = torch.empty((), dtype=dtype).element_size()
        head = align(CriticalCounters.nbytes(layers), PAGE)
        stride = align(max(numel, 1) * itemsize, PAGE)
        self.segment = host.allocate(tag, head + 2 * stride, CriticalCounters.initializer(0, layers))
        self.critical = CriticalCounters(self.segment, 0, layers, host.local_rank)
        self.sums = [self.segment.tensor(dtype, head + s * stride, numel) for s in (0, 1)]
