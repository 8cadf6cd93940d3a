"""One rank of a group on the ``shm`` backend that runs collectives and reports what they
returned (run by tests/backend/test_ops.py, without torchrun).

``python backend_ops_script.py CASE RANK PORT WORLD_SIZE`` (LOCAL_WORLD_SIZE in the
environment makes hosts of that many ranks). Prints one JSON line starting with ``RESULT``:
the rank, the case's outputs (each tensor as its dtype and values), and the calls of each
op that went through shared memory and to gloo in this process.

Inputs are :func:`inputs` of (seed, rank): the test rebuilds them to compute the definition.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import shmtrain  # noqa: F401 - registers the "shm" backend
from shmtrain.backend import ShmBackend

#: integer dtypes and their names in the report
INTEGERS = {"int8": torch.int8, "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8}


def inputs(dtype: torch.dtype, numel: int, seed: int, rank: int) -> torch.Tensor:
    """A rank's integers over the dtype's whole range (so that sums wrap around), and
    small ones of either sign (so that rounding toward zero differs from the floor)."""
    info = torch.iinfo(dtype)
    g = torch.Generator().manual_seed(1000 * seed + rank)
    wide = torch.randint(info.min, info.max, (numel,), generator=g, dtype=torch.int64)
    small = torch.randint(max(info.min, -9), 10, (numel,), generator=g, dtype=torch.int64)
    return torch.where(torch.arange(numel) % 2 == 0, wide, small).to(dtype)


def report(tensor: torch.Tensor) -> dict:
    return {"dtype": str(tensor.dtype).replace("torch.", ""), "values": tensor.tolist()}


def avg_int(rank: int, world: int) -> dict:
    """AVG of each integer dtype: one tensor (and a strided one), and a coalesced call."""
    out = {}
    for seed, (name, dtype) in enumerate(INTEGERS.items()):
        t = inputs(dtype, 1001, seed, rank)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        out[f"{name}/one"] = report(t)
        wide = torch.zeros(2 * 37, dtype=dtype)
        wide[::2] = inputs(dtype, 37, seed + 10, rank)
        strided = wide[::2]
        dist.all_reduce(strided, op=dist.ReduceOp.AVG)
        out[f"{name}/strided"] = report(strided)
        pair = [inputs(dtype, 5, seed + 20, rank), inputs(dtype, 300, seed + 30, rank)]
        dist.all_reduce_coalesced(pair, op=dist.ReduceOp.AVG)
        out[f"{name}/coalesced0"], out[f"{name}/coalesced1"] = report(pair[0]), report(pair[1])
    return out


CASES = {"avg_int": avg_int}

if __name__ == "__main__":
    case, rank, port, world = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    dist.init_process_group("shm", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    before, fallbacks = ShmBackend.reductions, ShmBackend.fallbacks
    outputs = CASES[case](rank, world)
    result = {"rank": rank, "outputs": outputs, "reductions": ShmBackend.reductions - before,
              "fallbacks": ShmBackend.fallbacks - fallbacks}
    dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)
