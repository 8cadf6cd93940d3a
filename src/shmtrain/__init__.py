"""shmtrain: data-parallel training on PyTorch through shared-memory parameter buffers.

Layers (imports flow upward only): ``fabric`` (how bytes move) -> ``strategies`` (how
workers share parameters) -> ``runtime`` (worker loop, launcher) -> ``cli``.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "DataParallel"]


def __getattr__(name: str):
    # Lazy, so ``import shmtrain`` stays cheap for the CLI's --help.
    if name == "DataParallel":
        from shmtrain.api import DataParallel

        return DataParallel
    raise AttributeError(name)
