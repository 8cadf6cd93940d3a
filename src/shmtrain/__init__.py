"""shmtrain: data-parallel training on PyTorch through shared-memory parameter buffers.

Layers (imports flow upward only): ``fabric`` (how bytes move) -> ``strategies`` (how
workers share parameters) -> ``api`` (DataParallel) and ``ddp`` (``ddp_comm_hook``, a
DistributedDataParallel communication hook) -> ``runtime`` (Trainer, worker
loop, launcher) -> ``bench`` -> ``cli``; docs/architecture.md.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "DataParallel", "ShmHookState", "Trainer", "ddp_comm_hook"]


def __getattr__(name: str):
    # Lazy, so ``import shmtrain`` stays cheap for the CLI's --help.
    if name == "DataParallel":
        from shmtrain.api import DataParallel

        return DataParallel
    if name in ("ddp_comm_hook", "ShmHookState"):
        from shmtrain import ddp

        return getattr(ddp, name)
    if name == "Trainer":
        from shmtrain.runtime.trainer import Trainer

        return Trainer
    raise AttributeError(name)
