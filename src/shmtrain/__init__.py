"""shmtrain: data-parallel training on PyTorch through shared-memory parameter buffers.

Layers (imports flow upward only): ``fabric`` (how bytes move) -> ``strategies`` (how
workers share parameters) -> ``parallel`` (DataParallel, and ``ddp_comm_hook``, a
DistributedDataParallel communication hook) and ``backend`` (``cpu:shm``) -> ``runtime`` (Trainer, worker
loop, launcher) -> ``bench`` -> ``cli``; docs/architecture.md.
"""

import importlib.util
import sys

__version__ = "0.1.0"

__all__ = ["__version__", "DataParallel", "ShmHookState", "Trainer", "ddp_comm_hook"]


def __getattr__(name: str):
    # Lazy, so ``import shmtrain`` stays cheap for the CLI's --help.
    if name == "DataParallel":
        from shmtrain.parallel.data_parallel import DataParallel

        return DataParallel
    if name in ("ddp_comm_hook", "ShmHookState"):
        from shmtrain.parallel import comm_hook

        return getattr(comm_hook, name)
    if name == "Trainer":
        from shmtrain.runtime.train.trainer import Trainer

        return Trainer
    raise AttributeError(name)


# -- the "shm" torch.distributed backend (shmtrain/backend/) ----------------
# Lazy: shmtrain/backend/__init__.py imports neither torch nor the fabric, so registering
# while torch.distributed is being imported runs no half-imported module; the group's
# modules are imported when a group is made (shmtrain.backend._create).
def _register_backend(dist) -> None:
    from shmtrain.backend import register  # imports neither torch nor the backend's modules

    register(dist)


class _RegisterWhenImported:
    """Registers the backend right after ``torch.distributed`` is imported, so ``import
    shmtrain`` works before or after ``import torch`` without importing torch itself (a
    meta-path finder needs only ``find_spec``; importlib.abc's base class would cost
    ``import shmtrain`` 50 ms, a window in which a Ctrl-C prints a traceback)."""

    def find_spec(self, name, path, target=None):
        if name != "torch.distributed":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            _register_backend(module)

        spec.loader.exec_module = exec_module
        return spec


if "torch.distributed" in sys.modules:
    _register_backend(sys.modules["torch.distributed"])
elif not any(isinstance(f, _RegisterWhenImported) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWhenImported())
