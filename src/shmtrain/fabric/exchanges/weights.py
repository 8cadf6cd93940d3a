"""The start-up broadcast of the weights: every worker begins from rank 0's.

Every strategy begins this way (e.g. TRL, Le Duc et al., Algorithm 5 line 2). ``layout``
is the strategy's flat layout of the model's parameters (anything with ``gather()`` and
``scatter(flat)``: ``strategies/layout/flat.py``).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist


def weights_digest(flat: torch.Tensor) -> torch.Tensor:
    """SHA-256 of a flat tensor's bytes as 4 int64s (32 bytes): equal digests, equal bits."""
    data = flat.detach().to("cpu").contiguous().view(torch.uint8).numpy()
    return torch.frombuffer(bytearray(hashlib.sha256(data).digest()), dtype=torch.int64).clone()


def broadcast_parameters(layout: Any, src: int = 0, comm: Any = None) -> bool:
    """Make every worker's weights equal to rank ``src``'s (once, at the start; every
    strategy begins this way, e.g. TRL Algorithm 5 line 2).

    Every worker builds its model from the run's seed, so the weights are usually the
    same bits everywhere already: the workers first all-gather a SHA-256 digest of their
    weights (32 bytes each) and send the weights only when some digest differs from rank
    ``src``'s, by the dense broadcast (a model built differently on some worker, a seed
    that depends on the rank). Across hosts that saves the whole model crossing the link
    (twice, for gloo's broadcast tree over 2 hosts x 2). ``comm``: the collectives
    (``all_gather``, ``broadcast``; default ``torch.distributed`` when initialised).
    Returns whether the weights were sent."""
    if comm is None:
        if not dist.is_initialized() or dist.get_world_size() <= 1:
            return False
        comm = dist
    flat = layout.gather()
    digest = weights_digest(flat)
    digests = [torch.empty_like(digest) for _ in range(comm.get_world_size())]
    comm.all_gather(digests, digest)
    if all(torch.equal(d, digests[src]) for d in digests):
        return False
    send_parameters(layout, src, comm, flat)
    return True


def send_parameters(layout: Any, src: int = 0, comm: Any = None, flat: torch.Tensor | None = None) -> None:
    """The dense broadcast of rank ``src``'s weights, whatever the others hold (what
    :func:`broadcast_parameters` falls back to; what BVLC/Caffe2 pay every iteration)."""
    if comm is None:
        if not dist.is_initialized() or dist.get_world_size() <= 1:
            return
        comm = dist
    flat = layout.gather() if flat is None else flat
    comm.broadcast(flat, src=src)
    layout.scatter(flat)
