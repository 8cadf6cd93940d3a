"""A DDP script that never imports shmtrain (run by tests/backend/test_entry_point.py under
plain torchrun): ``init_process_group(argv[1])`` finds the ``shm`` backend through the
``torch.distributed.backends`` entry point, an allreduce goes through shared memory, and
rank 0 writes what it saw to argv[2] as JSON."""

import json
import sys

import torch
import torch.distributed as dist

backend, out = sys.argv[1], sys.argv[2]
before = "shmtrain" in sys.modules
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.full((1000,), float(rank + 1))
dist.all_reduce(t)
group = sys.modules.get("shmtrain.backend.group")
seen = {
    "imported_before_init": before,
    "backend": dist.get_backend(),
    "sum": float(t[0]),
    "expected": world * (world + 1) / 2,
    "through_shm": group.ShmBackend.reductions if group is not None else 0,
}
dist.destroy_process_group()
if rank == 0:
    with open(out, "w") as f:
        json.dump(seen, f)
