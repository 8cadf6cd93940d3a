"""shmtrain: data-parallel training on PyTorch through shared-memory parameter buffers.

Layers (imports flow upward only): ``fabric`` (how bytes move) -> ``strategies`` (how
workers share parameters) -> ``api`` (DataParallel) -> ``runtime`` (Trainer, worker
loop, launcher) -> ``bench`` -> ``cli``; docs/architecture.md.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "DataParallel", "Trainer"]


def __getattr__(name: str):
    # Lazy, so ``import shmtrain`` stays cheap for the CLI's --help.
    if name == "DataParallel":
        from shmtrain.api import DataParallel

        return DataParallel
    if name == "Trainer":
        from shmtrain.runtime.trainer import Trainer

        return Trainer
    raise AttributeError(name)
