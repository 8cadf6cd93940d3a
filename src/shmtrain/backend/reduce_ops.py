"""What the ``shm`` backend's reductions compute per dtype: the dtypes that go through shared
memory, and AVG of integers as NCCL defines it.

NCCL's ``ncclAvg`` of an integer type (its ``FuncSumPostDiv``) sums in the tensor's own type,
wrapping around in two's complement as the type's addition does, and divides the sum by the
number of ranks once, at the end, rounding toward zero: the absolute value is divided and the
sign put back, so ``-7`` over 2 ranks is ``-3``, not ``-4``. The result keeps the input's
dtype (gloo and torch's true division would make it float, which an integer tensor cannot
hold: ``result type Float can't be cast to the desired output type Long``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: floating dtypes reduced in shared memory
FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
#: integer dtypes reduced in shared memory (SUM wraps; AVG as NCCL's, :func:`average_integers`):
#: gloo's, which the hosts' leaders reduce with across hosts (gloo has no int16 nor uint16-64)
INTEGERS = (torch.int8, torch.int32, torch.int64, torch.uint8)
#: every dtype of the shared-memory reductions (the call header's dtype code is the index)
DTYPES = FLOATS + INTEGERS


def average_integers(summed: torch.Tensor, ranks: int) -> torch.Tensor:
    """NCCL's ``ncclAvg`` of an integer tensor, from its sum over ``ranks`` ranks (in place):
    the quotient rounded toward zero, in the tensor's dtype."""
    return summed.div_(ranks, rounding_mode="trunc")


def average(summed: torch.Tensor, ranks: int) -> torch.Tensor:
    """The AVG of ``ranks`` ranks from their sum, in place: true division of floats (gloo's),
    NCCL's rounding toward zero of integers (:func:`average_integers`)."""
    if summed.is_floating_point() or summed.is_complex():
        return summed.div_(ranks)
    return average_integers(summed, ranks)

#: dtypes the other collectives move through shared memory (gloo's: no int16, no uint16-64)
MOVED = DTYPES + (torch.bool, torch.complex64, torch.complex128)
#: the reductions by their c10d names (``dist.ReduceOp``)
REDUCTIONS = ("SUM", "AVG", "MAX", "MIN", "PRODUCT", "BAND", "BOR", "BXOR")
#: the calls' kinds in the call header (its code is the index; 0 and 1: SUM and AVG of all_reduce)
KINDS = (REDUCTIONS + tuple(f"reduce_scatter {r}" for r in REDUCTIONS) + tuple(f"reduce {r}" for r in REDUCTIONS)
         + ("broadcast", "all_gather", "all_to_all", "gather", "scatter", "barrier"))
#: the call header's codes of :data:`MOVED` and :data:`KINDS` (a dict lookup per call)
MOVED_CODE = {dtype: code for code, dtype in enumerate(MOVED)}
KIND_CODE = {kind: code for code, kind in enumerate(KINDS)}
#: the kinds whose header carries a root
ROOTED = frozenset({"broadcast", "gather", "scatter", *(f"reduce {r}" for r in REDUCTIONS)})


def reduction(op: object) -> str | None:
    """The name in :data:`REDUCTIONS` of a ``dist.ReduceOp`` (None: PREMUL_SUM or another)."""
    import torch.distributed as dist

    for name in REDUCTIONS:
        if op == getattr(dist.ReduceOp, name):
            return name
    return None


def combine(op: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``out <- out (op) row`` in place, for the reductions other than the sum's pipeline."""
    return {"SUM": torch.Tensor.add_, "AVG": torch.Tensor.add_, "MAX": _max, "MIN": _min,
            "PRODUCT": torch.Tensor.mul_, "BAND": torch.Tensor.bitwise_and_, "BOR": torch.Tensor.bitwise_or_,
            "BXOR": torch.Tensor.bitwise_xor_}[op]


def _max(out: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    return torch.maximum(out, row, out=out)


def _min(out: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    return torch.minimum(out, row, out=out)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat uint8 view (no copy)."""
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
