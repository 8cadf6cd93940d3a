"""A script started without torchrun (as Lightning's launcher or ``mp.spawn`` start theirs:
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT only) that makes the default process group
itself, then wraps its model in ``shmtrain.DataParallel``: rank 0's group already serves
the store on MASTER_PORT. Run by tests/fabric/job/test_own_group.py; rank 0 prints the
weights' sum after two steps, every rank ``ok``."""

import torch
import torch.distributed as dist
from torch import nn

import shmtrain

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
net = nn.Linear(4, 2)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
model = shmtrain.DataParallel(net, opt, "ssgd")
x = torch.full((3, 4), float(rank + 1))
for _ in range(2):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
model.close()
grads = [torch.zeros(1) for _ in range(dist.get_world_size())]
dist.all_gather(grads, torch.tensor([float(sum(p.sum() for p in net.parameters()))]))
assert all(float(g) == float(grads[0]) for g in grads), grads  # the ranks agree
dist.destroy_process_group()
print("ok", flush=True)
