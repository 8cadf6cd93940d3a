"""Pack a model's parameters or gradients into one flat buffer with per-layer views (PACK).

swCaffe (Section V-A, "PACK") packs all layers' gradients into one buffer so a single
allreduce moves them; shmtrain goes one step further and lets backward write the
gradients straight into that buffer by making each ``param.grad`` a view of it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


class FlatLayout:
    """Offsets of a list of parameters inside one flat buffer."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        if not params:
            raise ValueError("the model has no trainable parameters")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters mix dtypes {sorted(map(str, dtypes))}; one dtype is needed")
        self.params = list(params)
        self.dtype = params[0].dtype
        self.shapes = [p.shape for p in params]
        self.offsets: list[tuple[int, int]] = []
        start = 0
        for p in params:
            self.offsets.append((start, start + p.numel()))
            start += p.numel()
        self.numel = start

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of ``flat`` (no copy)."""
        if flat.numel() < self.numel:
            raise ValueError(f"flat buffer holds {flat.numel()} elements, {self.numel} needed")
        return [flat[a:b].view(shape) for (a, b), shape in zip(self.offsets, self.shapes, strict=True)]

    def bind_grads(self, views: Sequence[torch.Tensor]) -> None:
        """Make every parameter's ``.grad`` the given view (backward then accumulates into it)."""
        for p, v in zip(self.params, views, strict=True):
            p.grad = v

    def bind_data(self, flat: torch.Tensor, copy: bool = True) -> list[torch.Tensor]:
        """Move the parameters' storage into ``flat`` (copying current values if ``copy``)."""
        views = self.views(flat)
        with torch.no_grad():
            for p, v in zip(self.params, views, strict=True):
                if copy:
                    v.copy_(p.data)
                p.data = v
        return views

    def gather(self, out: torch.Tensor | None = None, grads: bool = False) -> torch.Tensor:
        """Copy the parameters (or gradients) into one flat tensor."""
        out = torch.empty(self.numel, dtype=self.dtype) if out is None else out
        for p, v in zip(self.params, self.views(out), strict=True):
            src = p.grad if grads else p.data
            if src is None:
                v.zero_()
            else:
                v.copy_(src)
        return out

    def scatter(self, flat: torch.Tensor) -> None:
        """Copy a flat tensor back into the parameters."""
        with torch.no_grad():
            for p, v in zip(self.params, self.views(flat), strict=True):
                p.data.copy_(v)


def weights_digest(flat: torch.Tensor) -> torch.Tensor:
    """SHA-256 of a flat tensor's bytes as 4 int64s (32 bytes): equal digests, equal bits."""
    data = flat.detach().to("cpu").contiguous().view(torch.uint8).numpy()
    return torch.frombuffer(bytearray(hashlib.sha256(data).digest()), dtype=torch.int64).clone()


def broadcast_parameters(layout: FlatLayout, src: int = 0, comm: Any = None) -> bool:
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


def send_parameters(layout: FlatLayout, src: int = 0, comm: Any = None, flat: torch.Tensor | None = None) -> None:
    """The dense broadcast of rank ``src``'s weights, whatever the others hold (what
    :func:`broadcast_parameters` falls back to; what BVLC/Caffe2 pay every iteration)."""
    if comm is None:
        if not dist.is_initialized() or dist.get_world_size() <= 1:
            return
        comm = dist
    flat = layout.gather() if flat is None else flat
    comm.broadcast(flat, src=src)
    layout.scatter(flat)
