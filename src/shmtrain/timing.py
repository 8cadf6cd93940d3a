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
from typing import Any

COMPUTE_PHASES = ("forward", "backward", "update")


class PhaseTimer:
    """Accumulates seconds per phase for the current iteration."""

    def __init__(self) -> None:
        self.current: dict[str, float] = {}
        #: non-phase data of the iteration (e.g. per-layer times under ``layers``), written
        #: as extra keys of the metrics row next to ``time``
        self.details: dict[str, Any] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.current[name] = self.current.get(name, 0.0) + seconds

    def detail(self, key: str, value: Any) -> None:
        """Attach ``value`` to this iteration's row under ``key`` (JSON-serialisable)."""
        self.details[key] = value

    def take_details(self) -> dict[str, Any]:
        """The iteration's details, cleared for the next one (call after finish_iteration)."""
        details, self.details = self.details, {}
        return details

    def finish_iteration(self) -> dict[str, float]:
        """Close the iteration: return its phases with ``compute`` and ``comm`` totals."""
        phases = self.current
        self.current = {}
        phases["compute"] = sum(phases.get(name, 0.0) for name in COMPUTE_PHASES)
        phases.setdefault("comm", 0.0)
        return phases
