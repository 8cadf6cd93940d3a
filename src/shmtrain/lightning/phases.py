"""shmtrain's per-phase times (``forward``, ``backward``, ``comm``, ``update``, the papers'
own: :mod:`shmtrain.timing`) as Lightning logger metrics, ``shmtrain/<phase>`` in seconds,
the mean over the iterations since the last row."""

from __future__ import annotations

from typing import Any

from shmtrain.timing import PhaseTimer

PREFIX = "shmtrain/"


class PhaseLog:
    """Closes each iteration of ``timer`` and hands the means to a trainer's loggers.

    Args:
        timer: the DataParallel's timer (one per rank).
    """

    def __init__(self, timer: PhaseTimer) -> None:
        self.timer = timer
        self.sums: dict[str, float] = {}
        self.count = 0
        #: the last row handed to the loggers (for a caller that wants it without a logger)
        self.last: dict[str, float] = {}

    def close_iteration(self, trainer: Any) -> None:
        """Close the iteration; every ``trainer.log_every_n_steps`` steps log the means."""
        for name, seconds in self.timer.finish_iteration().items():
            self.sums[name] = self.sums.get(name, 0.0) + seconds
        self.count += 1
        every = max(1, int(getattr(trainer, "log_every_n_steps", 50) or 1))
        if (trainer.global_step + 1) % every:
            return
        self.last = {PREFIX + name: total / self.count for name, total in sorted(self.sums.items())}
        self.sums, self.count = {}, 0
        for logger in trainer.loggers:  # rank-zero-only loggers write rank 0's
            logger.log_metrics(self.last, step=trainer.global_step)
