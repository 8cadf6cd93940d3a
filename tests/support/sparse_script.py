"""One rank of the sparse allreduce test (tests/backend/test_sparse.py): sparse COO tensors
with duplicate indices, uneven counts of non-zeros (one rank's empty), in float32, float64
and int64, summed on the ``shm`` group and on a gloo group of the same processes; prints
``RESULT`` with whether each pair is equal bit for bit and the calls per op."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import shmtrain  # noqa: F401 - registers the "shm" backend
from shmtrain.backend.group import ShmBackend


def sparse_input(rank: int, dtype: torch.dtype, case: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * case + rank)
    nnz = 0 if rank == 1 and case == 0 else 3 + 5 * rank + case
    indices = torch.randint(0, 7, (2, nnz), generator=generator)  # duplicates: coalesced by the op
    values = (torch.randn(nnz, 3, generator=generator) * 100).to(dtype)
    return torch.sparse_coo_tensor(indices, values, (7, 7, 3))


def main() -> None:
    _case, rank, port, world = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])  # the one case: sum
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world))
    dist.init_process_group("shm", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    gloo = dist.new_group(backend="gloo")
    equal = {}
    for dtype in (torch.float32, torch.float64, torch.int64):
        for case in range(3):
            ours, theirs = sparse_input(rank, dtype, case), sparse_input(rank, dtype, case)
            dist.all_reduce(ours)
            dist.all_reduce(theirs, group=gloo)
            ours, theirs = ours.coalesce(), theirs.coalesce()
            equal[f"{dtype}/{case}"] = (ours.dtype == theirs.dtype and torch.equal(ours.indices(), theirs.indices())
                                       and torch.equal(ours.values(), theirs.values()))
    counts = {"through_shm": dict(ShmBackend.through_shm), "through_gloo": dict(ShmBackend.through_gloo)}
    dist.destroy_process_group()
    print("RESULT " + json.dumps({"rank": rank, "equal": equal, **counts}), flush=True)
    os._exit(0)  # torch's gloo teardown may abort after the report (tests/support/script_exit.py)


if __name__ == "__main__":
    main()
