"""An unchanged DDP script whose backend is the first argument (run by
tests/backend/test_backend.py under torchrun): collectives, then 5 DDP steps; rank 0 saves the weights to argv[2]."""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import shmtrain  # noqa: F401 - registers the "shm" backend
from shmtrain.backend import ShmProcessGroup

backend, out = sys.argv[1], sys.argv[2]
shm = backend in ("shm", "cpu:shm")


def through_shm(before: int, count: int) -> None:
    """The last collectives went through shared memory ``count`` times (none on gloo)."""
    assert ShmProcessGroup.reductions - before == (count if shm else 0), (backend, ShmProcessGroup.reductions, before)


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


threads_before = threads()
dist.init_process_group(backend)
r, w = dist.get_rank(), dist.get_world_size()
t = torch.full((100_003,), float(r + 1))
before = ShmProcessGroup.reductions
dist.all_reduce(t)
assert float(t[0]) == w * (w + 1) / 2 and float(t[-1]) == w * (w + 1) / 2, float(t[0])
t = torch.full((1000,), float(r + 1))
dist.all_reduce(t, op=dist.ReduceOp.AVG)
assert float(t[0]) == (w + 1) / 2
through_shm(before, 2)  # SUM and AVG of floats: shared memory
before = ShmProcessGroup.reductions
t = torch.full((10,), float(r))
dist.all_reduce(t, op=dist.ReduceOp.MAX)  # gloo's
assert float(t[0]) == w - 1
b = torch.full((5,), float(r))
dist.broadcast(b, src=w - 1)
assert float(b[0]) == w - 1
gathered = [torch.zeros(3) for _ in range(w)]
dist.all_gather(gathered, torch.full((3,), float(r)))
assert [float(g[0]) for g in gathered] == [float(k) for k in range(w)]
dist.barrier()
through_shm(before, 0)  # MAX, broadcast, all_gather: gloo's
fallbacks = ShmProcessGroup.fallbacks
assert not shm or fallbacks >= 1, fallbacks  # MAX was counted as gloo's
before = ShmProcessGroup.reductions
i = torch.full((10,), r, dtype=torch.int64)
dist.all_reduce(i)  # integers: shared memory
assert int(i[0]) == w * (w - 1) // 2
if shm:  # Lightning's sync_dist counter: NCCL's integer AVG (gloo raises: Float can't be cast to Long)
    steps = torch.tensor([2 * r - 3], dtype=torch.int64)
    dist.all_reduce(steps, op=dist.ReduceOp.AVG)
    assert steps.dtype == torch.int64 and int(steps) == int((w * (w - 1) - 3 * w) / w), steps  # toward zero
through_shm(before, 2)

# a real c10d backend (group names, per-device dispatch, subgroups), and
# allreduce_coalesced reducing each tensor on its own whatever the op and the dtypes
world = dist.group.WORLD
assert world.group_name, "the group has a name"
assert dist.get_backend() == backend, dist.get_backend()
pair = [torch.tensor([1.0, 4.0]) + r, torch.tensor([2.0, 3.0]) - r]
dist.all_reduce_coalesced(pair, op=dist.ReduceOp.MAX)
assert pair[0].tolist() == [w, w + 3.0] and pair[1].tolist() == [2.0, 3.0], pair  # not [4, 4]
before = ShmProcessGroup.reductions
total = w * (w + 1) / 2
ints = [torch.full((4,), r + 1), torch.full((3,), 10 * (r + 1))]
dist.all_reduce_coalesced(ints)  # integers: shared memory too
assert ints[0].tolist() == [total] * 4 and ints[1].tolist() == [10 * total] * 3, ints
floats = [torch.full((4,), float(r + 1)), torch.full((6, 4), float(r + 1))[:, ::2]]
dist.all_reduce_coalesced(floats)
assert floats[0].tolist() == [total] * 4 and bool((floats[1] == total).all()), floats
through_shm(before, 4)  # the two integer and the two float tensors (one strided) in shared memory
gathered = [[torch.zeros(2), torch.zeros(3)] for _ in range(w)]  # per rank, its two tensors
dist.all_gather_coalesced(gathered, [torch.full((2,), float(r)), torch.full((3,), float(-r))])
assert [(float(a[0]), float(b[0])) for a, b in gathered] == [(float(k), float(-k)) for k in range(w)], gathered
dist.monitored_barrier(wait_all_ranks=True)
sub = dist.new_group([0, 1])
if r < 2:
    assert sub.group_name and dist.get_backend(sub) == dist.get_backend()
    s = torch.full((7,), float(r + 1))
    dist.all_reduce(s, group=sub)
    assert float(s[0]) == 3.0, s
dist.destroy_process_group(sub)  # a subgroup is destroyed whole; the default group goes on
halves, _ = dist.new_subgroups(group_size=2, group=world)
h = torch.ones(5)
dist.all_reduce(h, group=halves)
assert float(h[0]) == 2.0, h
fallbacks = ShmProcessGroup.fallbacks
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
ddp = DDP(model, bucket_cap_mb=0.01)  # several buckets, reduced while backward goes on
opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
g = torch.Generator().manual_seed(r)
for _ in range(5):
    x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
    opt.zero_grad()
    nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()
assert not shm or ShmProcessGroup.reductions - before >= 5, ShmProcessGroup.reductions  # a bucket a step at least
assert ShmProcessGroup.fallbacks == fallbacks, "a DDP bucket went to gloo"
# create_graph=True hands DDP's buckets over as tensors that require grad (this crashed
# both ranks with SIGSEGV): they are reduced on their data, as gloo does
before = ShmProcessGroup.reductions



class Square(nn.Module):  # the model of PyTorch's test_ddp_create_graph
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor(1.0))

    def forward(self) -> torch.Tensor:
        return self.p.pow(2)


graph = DDP(Square())
for _ in range(3):
    graph().backward(create_graph=True)
assert all(p.requires_grad for p in graph.parameters())
assert not shm or ShmProcessGroup.reductions > before, "create_graph's bucket did not go through shared memory"
if r == 0:
    torch.save(model.state_dict(), out)
dist.barrier()  # every rank done before any tears its groups down
dist.destroy_process_group()
if shm:  # the backend joins every thread it started (its own, its gloo's) at destroy
    assert threads() == threads_before, (threads_before, threads(), "a thread outlived the groups")
else:
    # torch's own gloo keeps its threads past destroy_process_group (3 here, whatever the
    # references dropped), and a gloo thread that frees a finished work's tensors during
    # the interpreter's finalization needs the GIL and aborts the process ("terminate
    # called without an active exception"; 1 reference run in ~15 under load). The
    # reference is done: leave without finalizing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
