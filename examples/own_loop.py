"""Train with your own PyTorch loop, written as for DistributedDataParallel; shmtrain
shares the gradients (docs/convert_ddp.md: the wrapper line is the only change).

Run on one host with 2 processes:

    torchrun --nproc-per-node 2 examples/own_loop.py --steps 20 --out /tmp/own_loop.pt

or across hosts with torchrun's usual --nnodes/--node-rank/--master-addr flags. Each
process trains on its own slice of every global batch (digits, from scikit-learn);
the weights stay identical on every worker. Rank 0 saves the final weights.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import shmtrain
from shmtrain.runtime.data.tensors import load_digits_data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--strategy", default="ssgd")
    parser.add_argument("--out", help="where rank 0 saves the final state_dict")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    # was: model = DistributedDataParallel(model); joins torchrun's job
    model = shmtrain.DataParallel(model, optimizer, strategy=args.strategy)
    rank, world = model.ctx.rank, model.ctx.world_size

    data = load_digits_data()
    loss_fn = nn.CrossEntropyLoss()
    global_batch = args.batch_size * world
    for step in range(args.steps):
        start = (step * global_batch) % (len(data.train_x) - global_batch) + rank * args.batch_size
        x = data.train_x[start : start + args.batch_size]
        y = data.train_y[start : start + args.batch_size]
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()  # synchronous strategies: the gradients are the job's mean here
        optimizer.step()  # the strategy's step
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    if rank == 0 and args.out:
        torch.save(model.module.state_dict(), args.out)
    model.close()


if __name__ == "__main__":
    main()
