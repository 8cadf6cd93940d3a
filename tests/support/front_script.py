"""One rank of the C++ front's test (tests/backend/test_front.py): small float32 SUM and AVG
allreduces (one that requires grad, an empty one, one of the call ring's whole payload),
barriers, broadcasts from every root and all_gather_into_tensor of three dtypes on the
``shm`` group, each compared bit for bit with the Python backend's own path
(its ``allreduce`` called directly) and with gloo's on a group of the same processes; then
a large one and a float64 one, which the front hands to the Python backend. Prints
``RESULT`` with what was equal, how many calls the front finished, the counts per op and
the backend's type."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import shmtrain  # noqa: F401 - registers the "shm" backend
from shmtrain.backend import ShmBackend, shm_backend
from shmtrain.backend.calls import CALL_BYTES


def late(rank: int, world: int, gloo: object) -> None:
    """Rank 1 comes 0.2 s late to each call: the front's wait outlasts its slice and the
    Python backend finishes the call; every result still equals gloo's."""
    generator = torch.Generator().manual_seed(rank)
    equal = {}
    for name in ("all_reduce", "broadcast", "all_gather_into_tensor", "barrier"):
        data = torch.randint(-100, 100, (64,), generator=generator).float()
        ours, theirs = data.clone(), data.clone()
        gathered, expected = torch.zeros(64 * world), torch.ones(64 * world)
        if rank == 1:
            time.sleep(0.2)
        if name == "all_reduce":
            dist.all_reduce(ours)
            dist.all_reduce(theirs, group=gloo)
        elif name == "broadcast":
            dist.broadcast(ours, src=world - 1)
            dist.broadcast(theirs, src=world - 1, group=gloo)
        elif name == "all_gather_into_tensor":
            dist.all_gather_into_tensor(gathered, data)
            dist.all_gather_into_tensor(expected, data, group=gloo)
            ours, theirs = gathered, expected
        else:
            dist.barrier()
        equal[name] = torch.equal(ours, theirs)
    gate = shm_backend().reducer.gate
    print("RESULT " + json.dumps({"rank": rank, "equal": equal, "fast": gate.fast if gate else 0,
                                  "through_shm": dict(ShmBackend.through_shm)}), flush=True)


def main() -> None:
    case, rank, port, world = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world))
    dist.init_process_group("cpu:shm", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    gloo = dist.new_group(backend="gloo")
    if case == "late":
        late(rank, world, gloo)
        dist.destroy_process_group()
        return
    front = dist.group.WORLD._get_backend(torch.device("cpu"))
    gate = shm_backend().reducer.gate
    generator = torch.Generator().manual_seed(rank)
    equal, gloos, close = {}, {}, {}
    before = ShmBackend.reductions
    sizes = {"small": 1000, "empty": 0, "whole payload": CALL_BYTES // 4}
    for name, numel in sizes.items():
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            data = torch.randn(numel, generator=generator) * 1000
            ours, python, theirs = data.clone(), data.clone(), data.clone()
            dist.all_reduce(ours, op=op)
            options = dist.AllreduceOptions()
            options.reduceOp = op
            shm_backend().allreduce([python], options).wait()  # the Python backend's own path
            dist.all_reduce(theirs, op=op, group=gloo)
            equal[f"{name} {op}"] = torch.equal(ours, python)
            gloos[f"{name} {op}"] = torch.equal(ours, theirs)
            close[f"{name} {op}"] = torch.allclose(ours, theirs, rtol=1e-5, atol=1e-3)
    weight = torch.full((5,), float(rank + 1), requires_grad=True)
    version = weight._version
    dist.all_reduce(weight.detach())
    equal["requires grad"] = torch.equal(weight.detach(), torch.full((5,), sum(range(1, world + 1)) * 1.0))
    bumped = weight._version > version
    for _ in range(3):
        dist.barrier()
    for dtype in (torch.float32, torch.int64, torch.bool):  # exact ops: gloo's bits at any world size
        for root in range(world):
            data = (torch.randn(77, generator=generator) * 100).to(dtype)
            ours, theirs = data.clone(), data.clone()
            dist.broadcast(ours, src=root)
            dist.broadcast(theirs, src=root, group=gloo)
            gloos[f"broadcast {dtype} from {root}"] = torch.equal(ours, theirs)
        data = (torch.randn(33, generator=generator) * 100).to(dtype)
        ours, theirs = torch.zeros(33 * world, dtype=dtype), torch.ones(33 * world, dtype=dtype)
        dist.all_gather_into_tensor(ours, data)
        dist.all_gather_into_tensor(theirs, data, group=gloo)
        gloos[f"all_gather_into_tensor {dtype}"] = torch.equal(ours, theirs)
    fast = gate.fast if gate is not None else 0
    large = torch.ones(CALL_BYTES // 4 + 1)
    dist.all_reduce(large)
    doubles = torch.ones(10, dtype=torch.float64)
    dist.all_reduce(doubles)
    equal["large"] = bool((large == world).all())
    equal["float64"] = bool((doubles == world).all())
    result = {"rank": rank, "equal": equal, "gloo": gloos, "close": close, "bumped": bumped,
              "front": type(front).__name__, "fast": fast, "fast_after": gate.fast if gate is not None else 0,
              "reductions": ShmBackend.reductions - before, "through_shm": dict(ShmBackend.through_shm)}
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
