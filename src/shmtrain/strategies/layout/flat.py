"""Pack a model's parameters or gradients into one flat buffer with per-layer views (PACK).

swCaffe (Section V-A, "PACK") packs all layers' gradients into one buffer so a single
allreduce moves them; shmtrain goes one step further and lets backward write the
gradients straight into that buffer by making each ``param.grad`` a view of it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
