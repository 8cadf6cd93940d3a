"""What a strategy says and does about a worker killed on one host and replaced in place
(``runtime/run/recovery.py``, ``runtime/launch/replacement.py``): how it recovers, which
ranks are its replicas, and the state a survivor keeps; :class:`~shmtrain.strategies.base.Strategy`
has these, each strategy overrides what it needs."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar


class RecoveryHooks:
    """A strategy's recovery in place; needs the strategy's ``ctx``."""

    #: how a worker killed on one host is recovered (``runtime/run/recovery.py``): replaced in
    #: place, from the survivor with the most steps (``"replica"``) or from W_g (``"elastic"``),
    #: or ``"restart"``: every worker restarted from the latest checkpoint
    recovery: ClassVar[str] = "restart"

    ctx: Any

    def replicas(self) -> range:
        """The block of consecutive ranks whose state equals this rank's between steps
        (recovery in place): every rank for a replica, this one alone otherwise."""
        return range(self.ctx.world_size) if self.recovery == "replica" else range(self.ctx.rank, self.ctx.rank + 1)

    def prepare_recovery(self, folder: Path) -> None:
        """A worker killed on one host will be replaced in place (``runtime/run/recovery.py``):
        keep, in the launch's private ``folder``, what a survivor's state needs beyond its
        own (nothing by default: a replica's or an asynchronous worker's own state is whole
        between steps)."""

    def recovery_state(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """``state`` (this rank's, kept after a peer's death, ``Trainer.state_dict``) made
        the state after its last whole step; None where that cannot be had (every worker
        restarts instead). By default ``state`` itself."""
        return state

    def adopted_state(self, state: dict[str, Any], folder: Path | None) -> dict[str, Any]:
        """The state this rank goes on from after a recovery in place (its own kept one, or
        a donor's), as this rank loads it: by default ``state`` itself; a strategy whose
        ranks hold parts of their own (``--sharded-update``'s momentum chunks) puts this
        rank's part in, from its journal in the launch's private ``folder``."""
        return state
