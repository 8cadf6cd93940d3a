"""The two strategies that communicate nothing: ``nocomm`` (every worker alone on its
shard, the floor the step benchmark compares every strategy against) and ``single`` (one
process: the reference every synchronous strategy must equal)."""

from __future__ import annotations

from shmtrain.strategies.base import Strategy, register


@register
class NoComm(Strategy):
    """No communication at all: every worker trains alone on its shard (the floor that
    the step benchmark compares every strategy against)."""

    name = "nocomm"


@register
class Single(NoComm):
    """One process, plain SGD: the reference every synchronous strategy must equal."""

    name = "single"
    world = "one"
