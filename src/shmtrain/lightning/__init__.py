"""shmtrain's methods inside Lightning's Trainer (Lightning is an optional extra:
``pip install 'shmtrain[lightning]'``)::

    import lightning.pytorch as pl
    from shmtrain.lightning import ShmtrainStrategy

    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ShmtrainStrategy("seasgd", update_interval=4))
    trainer.fit(module, loader)

Files: ``strategy.py`` (:class:`ShmtrainStrategy`, Lightning's ``DDPStrategy`` with
:class:`shmtrain.DataParallel` where DDP's wrapper was), ``shards.py`` (every rank's own
state beside Lightning's checkpoint, for the methods whose ranks differ), ``phases.py``
(shmtrain's per-phase times handed to Lightning's loggers). docs/integrations.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ShmtrainStrategy"]


def __getattr__(name: str) -> Any:
    # lazy: ``import shmtrain.lightning`` names the missing extra only when it is used
    if name == "ShmtrainStrategy":
        from shmtrain.lightning.strategy import ShmtrainStrategy

        return ShmtrainStrategy
    raise AttributeError(name)
