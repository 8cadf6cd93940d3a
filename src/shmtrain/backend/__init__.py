"""A torch.distributed backend whose allreduce goes through the host's shared memory.

``import shmtrain`` registers it (:func:`register`), so an unchanged DDP
script gets the speed-up by naming it::

    dist.init_process_group("cpu:shm")        # or backend="shm"
    ddp = DistributedDataParallel(model)      # its buckets are averaged in shared memory

It is declared as PyTorch expects of a third-party CPU backend:
``dist.Backend.register_backend("shm", creator, extended_api=True, devices=["cpu"])``,
whose creator returns a c10d ``Backend`` (:class:`~shmtrain.backend.group.ShmBackend`)
that torch.distributed wraps in its own ``ProcessGroup``. SUM and AVG of float and
integer CPU tensors (AVG of integers as NCCL's) go through shared memory
(:mod:`shmtrain.backend.reducer`), and inside a host every other collective too
(:mod:`shmtrain.backend.collectives`); the rest is gloo's. A failure fails the call's
``Work`` (:mod:`shmtrain.backend.work`) and the group.

This module imports neither torch nor the backend's modules until they are needed: the
registration runs inside ``import torch.distributed`` (``shmtrain/__init__.py``'s hook).
"""

from __future__ import annotations

from typing import Any

NAME = "shm"

__all__ = ["NAME", "register", "shm_backend", "ShmBackend", "ShmBackendError", "ShmProcessGroup", "ShmWork"]


def register(dist: Any = None) -> None:
    """Register the ``shm`` backend with torch.distributed (idempotent; ``import shmtrain``
    already does). ``dist``: the ``torch.distributed`` module (imported when omitted)."""
    if dist is None:
        import torch.distributed as dist
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])


def shm_backend(group: Any = None) -> Any:
    """The :class:`~shmtrain.backend.group.ShmBackend` of ``group`` (default the default
    group) on the CPU: behind its C++ front (:mod:`~shmtrain.backend.front`) where it has
    one, which ``ProcessGroup._get_backend`` returns."""
    import torch
    import torch.distributed as dist

    backend = (group if group is not None else dist.group.WORLD)._get_backend(torch.device("cpu"))
    return getattr(backend, "inner", backend)


def _create(options: Any, backend_options: Any = None) -> Any:
    from shmtrain.backend.group import ShmBackend

    return ShmBackend.create(options, backend_options)


def __getattr__(name: str) -> Any:
    if name in ("ShmBackend", "ShmProcessGroup"):
        from shmtrain.backend import group

        return getattr(group, name)
    if name in ("ShmBackendError", "ShmWork"):
        from shmtrain.backend import work

        return getattr(work, name)
    raise AttributeError(name)
