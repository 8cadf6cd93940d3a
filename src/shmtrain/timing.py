"""Per-iteration phase timers: every strategy reports its phases under shared names.

Phase names (seconds): ``forward``, ``backward``, ``update`` (optimizer), ``data``
(waiting for the next batch), ``comm`` (communication the training thread waited for)
and strategy-specific ones from the papers (``rgw``, ``ulw``, ``wwi``, ``ugw``,
``wait``; ``gather``, ``average``, ``broadcast``; ``collect_remaining``,
``accumulate``). ``compute`` is forward + backward + update.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

COMPUTE_PHASES = ("forward", "backward", "update")


class PhaseTimer:
    """Accumulates seconds per phase for the current iteration."""

    def __init__(self) -> None:
        self.current: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.current[name] = self.current.get(name, 0.0) + seconds

    def finish_iteration(self) -> dict[str, float]:
        """Close the iteration: return its phases with ``compute`` and ``comm`` totals."""
        phases = self.current
        self.current = {}
        phases["compute"] = sum(phases.get(name, 0.0) for name in COMPUTE_PHASES)
        phases.setdefault("comm", 0.0)
        return phases
