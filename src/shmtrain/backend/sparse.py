"""The SUM allreduce of a sparse (COO) tensor inside one host, through shared memory.

gloo's sparse allreduce (``ProcessGroupGloo``'s sparse work) coalesces each rank's input,
all-gathers the ranks' indices and values, adds the ranks' tensors in rank order and
coalesces the sum. The same steps here, with the host's all-gathers
(:meth:`~shmtrain.backend.collectives.Collectives._gather_all`): first every rank's count
of non-zeros, then its indices and values padded to the largest count, so each gather
moves equal pieces; the sum is built in the same order with the same torch operations,
so the result is gloo's bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C._distributed_c10d import Work

from shmtrain.backend.work import ShmWork

#: the op name the gathers of a sparse allreduce are counted under
OP = "all_reduce_sparse"


def _gathered(backend: Any, tensor: torch.Tensor) -> torch.Tensor | None:
    """Every local rank's ``tensor`` (equal shapes), stacked in rank order; None where the
    host's all-gather cannot take it."""
    size = backend.reducer.local_world
    output = torch.empty((size, *tensor.shape), dtype=tensor.dtype)
    work = backend._gather_all(OP, [(output, tensor.contiguous())], [output], "all_gather_into_tensor")
    if work is None:
        return None
    work.wait()
    return output


def all_reduce(backend: Any, tensor: torch.Tensor) -> Work | None:
    """SUM of the host's sparse ``tensor`` into it (module docstring); None where it is
    not one host's CPU COO tensor (gloo takes the call)."""
    if tensor.layout != torch.sparse_coo or tensor.device.type != "cpu" or backend.reducer.hosts != 1:
        return None
    mine = tensor.detach().coalesce()
    indices, values = mine._indices(), mine._values()
    counts = _gathered(backend, torch.tensor([indices.shape[1]], dtype=torch.int64))
    if counts is None:
        return None
    width = max(1, int(counts.max()))  # an empty gather has no pieces to move
    padded_indices = torch.zeros((indices.shape[0], width), dtype=indices.dtype)
    padded_indices[:, : indices.shape[1]] = indices
    padded_values = torch.zeros((width, *values.shape[1:]), dtype=values.dtype)
    padded_values[: values.shape[0]] = values
    all_indices = _gathered(backend, padded_indices)
    all_values = _gathered(backend, padded_values)
    if all_indices is None or all_values is None:
        return None
    pieces = [torch.sparse_coo_tensor(all_indices[r][:, :n], all_values[r][:n], mine.shape, dtype=mine.dtype)
              for r, n in enumerate(counts.view(-1).tolist())]
    output = pieces[0]
    for piece in pieces[1:]:
        output += piece
    with torch.no_grad():
        tensor.copy_(output.coalesce())
    return ShmWork([tensor], pending=False)
