"""Per-iteration phase timers: every strategy reports its phases under shared names.

Phase names (seconds): ``forward``, ``backward``, ``update`` (optimizer), ``data``
(waiting for the next batch), ``comm`` (communication the training thread waited for)
and strategy-specific ones from the papers (``rgw``, ``ulw``, ``wwi``, ``ugw``,
``wait``; ``gather``, ``average``, ``broadcast``; ``collect_remaining``,
``accumulate``; ``outer_update``, diloco's outer step; staged through host memory:
``copy_to_host``, ``copy_to_device``, TRL Table 4's copies, and ``d2h_wait``, the part
of the copies to host left after backward). ``compute`` is forward + backward + update.

On a GPU the work of a phase is queued, not done, when the host leaves it: a
:class:`PhaseTimer` made with a CUDA device times ``forward``, ``backward`` and
``update`` with CUDA events on the current stream instead of host clocks, and resolves
them when the iteration closes (:meth:`PhaseTimer.finish_iteration`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

COMPUTE_PHASES = ("forward", "backward", "update")


class PhaseTimer:
    """Accumulates seconds per phase for the current iteration.

    Args:
        device: where the computation runs; a CUDA device makes the compute phases
            (:data:`COMPUTE_PHASES`) timed by CUDA events. None or the CPU: host clocks.
    """

    def __init__(self, device: Any = None) -> None:
        self.current: dict[str, float] = {}
        #: non-phase data of the iteration (e.g. per-layer times under ``layers``), written
        #: as extra keys of the metrics row next to ``time``
        self.details: dict[str, Any] = {}
        self.device = device
        self.cuda = device is not None and getattr(device, "type", str(device).split(":")[0]) == "cuda"
        self._events: list[tuple[str, Any, Any]] = []
        self._copies: list[tuple[str, list[Any]]] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.cuda and name in COMPUTE_PHASES:
            import torch

            stream = torch.cuda.current_stream(self.device)  # the model's device, not the current one
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record(stream)
            try:
                yield
            finally:
                end.record(stream)
                self._events.append((name, begin, end))
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.current[name] = self.current.get(name, 0.0) + seconds

    def add_copies(self, name: str, copies: list[Any]) -> None:
        """Add the seconds of ``copies`` (:class:`shmtrain.strategies.layout.staging.Copy`, still in
        flight) to ``name`` when the iteration closes, so nobody waits for them before."""
        if copies:
            self._copies.append((name, copies))
        if len(self._copies) > 64:  # a caller that never closes iterations (the bare API)
            for entry in self._copies[:-1]:
                self.add(entry[0], sum(copy.wait() for copy in entry[1]))
            del self._copies[:-1]

    def detail(self, key: str, value: Any) -> None:
        """Attach ``value`` to this iteration's row under ``key`` (JSON-serialisable)."""
        self.details[key] = value

    def take_details(self) -> dict[str, Any]:
        """The iteration's details, cleared for the next one (call after finish_iteration)."""
        details, self.details = self.details, {}
        return details

    def finish_iteration(self) -> dict[str, float]:
        """Close the iteration: return its phases with ``compute`` and ``comm`` totals
        (on a GPU this waits for the events of the iteration's compute phases)."""
        for name, begin, end in self._events:
            end.synchronize()
            self.add(name, begin.elapsed_time(end) / 1e3)
        self._events.clear()
        for name, copies in self._copies:
            self.add(name, sum(copy.wait() for copy in copies))
        self._copies.clear()
        phases = self.current
        self.current = {}
        phases["compute"] = sum(phases.get(name, 0.0) for name in COMPUTE_PHASES)
        phases.setdefault("comm", 0.0)
        return phases
