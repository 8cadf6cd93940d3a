"""A DDP-style training script of one's own, with checkpoints that survive Ctrl-C.

Run it on 2 local workers with shmtrain's launcher, or with torchrun, unchanged::

    shmtrain run --workers 2 examples/ddp_script.py --steps 300 --ckpt /tmp/ddp.pt --resume
    torchrun --nproc-per-node 2 examples/ddp_script.py --steps 300 --ckpt /tmp/ddp.pt --resume

Ctrl-C (or SIGTERM) stops every worker at the same step; rank 0 saves the model, the
optimizer and the step to --ckpt (atomically: a temporary file, then a rename), as it
does every --ckpt-every steps and at the end. The same command run again continues from
it (--resume) and reaches the weights an uninterrupted run reaches. The model is
examples/mynet.py's Net, on scikit-learn's digits or, with ``--data DIR``, on a folder of
images with one sub-folder per class (``python examples/make_image_folder.py DIR`` makes
one; use DIR/train), read as a DDP script reads one: torchvision's ``ImageFolder``, a
``DistributedSampler`` re-seeded every epoch, a ``DataLoader`` decoding in
``--loader-workers`` processes. AdamW, gradient clipping, and gradient accumulation over
2 micro-batches, the first under ``model.no_sync()``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from mynet import Net  # sys.path[0] is examples/ (python, torchrun, shmtrain run)
from torch import nn

import shmtrain
from shmtrain.runtime.data.tensors import load_digits_data

MICRO_BATCHES = 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps in all (the run's total)")
    parser.add_argument("--batch-size", type=int, default=16, help="per worker and micro-batch")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm to clip to")
    parser.add_argument("--width", type=int, default=8, help="Net's width")
    parser.add_argument("--strategy", default="ssgd", help="a shmtrain strategy (ssgd: synchronous)")
    parser.add_argument("--ckpt", type=Path, help="checkpoint file (rank 0 writes it)")
    parser.add_argument("--ckpt-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--resume", action="store_true", help="continue from --ckpt when it exists")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--data", type=Path, help="a folder of images, one sub-folder per class (default: digits)")
    parser.add_argument("--loader-workers", type=int, default=2, help="DataLoader processes decoding --data")
    return parser.parse_args()


def save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Rank 0: model, optimizer and step, written whole or not at all."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def agreed_stop(requested: dict[str, int]) -> int:
    """The signal any worker got (0: none): every worker stops after the same step."""
    flag = torch.tensor([requested["signum"]], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def digits_batches(batch: int, rank: int, world: int) -> tuple[tuple[int, ...], int, Callable[[int], Iterator]]:
    """Input shape, classes, and micro-batches from a step on: slices of the digits, a
    function of the step (so a resumed run reads what a straight one reads)."""
    data = load_digits_data()
    per_step = batch * MICRO_BATCHES * world

    def batches(first_step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for step in range(first_step, 1 << 62):
            base = (step * per_step) % (len(data.train_x) - per_step)
            for micro in range(MICRO_BATCHES):
                start = base + (micro * world + rank) * batch
                yield data.train_x[start:start + batch], data.train_y[start:start + batch]

    return (1, 8, 8), 10, batches


def folder_batches(root: Path, batch: int, rank: int, world: int,
                   workers: int) -> tuple[tuple[int, ...], int, Callable[[int], Iterator]]:
    """Input shape, classes, and micro-batches from a step on, as a DDP script reads an image
    folder: each epoch a ``DistributedSampler`` order (seed 0 + epoch); a resumed run skips
    the steps of its epoch already taken."""
    from torch.utils.data import DataLoader, DistributedSampler
    from torchvision import datasets, transforms

    dataset = datasets.ImageFolder(str(root), transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))]))
    sampler = DistributedSampler(dataset, world, rank, shuffle=True, seed=0, drop_last=True)
    per_step = batch * MICRO_BATCHES
    steps_per_epoch = len(sampler) // per_step
    if steps_per_epoch < 1:
        sys.exit(f"--data {root}: {len(dataset)} images are fewer than one step takes "
                 f"({per_step * world}); use a smaller --batch-size or more images")

    def batches(first_step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch, skip = divmod(first_step, steps_per_epoch)
        while True:
            sampler.set_epoch(epoch)
            order = list(sampler)[skip * per_step:steps_per_epoch * per_step]
            yield from DataLoader(dataset, batch_size=batch, sampler=order, num_workers=workers)
            epoch, skip = epoch + 1, 0

    return tuple(dataset[0][0].shape), len(dataset.classes), batches


def main() -> None:
    args = parse_args()
    requested = {"signum": 0}

    def on_signal(signum: int, frame) -> None:  # noqa: ARG001
        requested["signum"] = signum  # acted on after the current step, by every worker at once

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # env:// from torchrun's (or shmtrain run's) variables
    rank, world = dist.get_rank(), dist.get_world_size()

    if args.data is not None:
        shape, classes, batches = folder_batches(args.data, args.batch_size, rank, world, args.loader_workers)
    else:
        shape, classes, batches = digits_batches(args.batch_size, rank, world)
    torch.manual_seed(0)
    net = Net(shape, classes, width=args.width)
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-2)
    step = 0
    if args.ckpt is not None and args.ckpt.exists():
        if not args.resume:
            sys.exit(f"{args.ckpt} exists: add --resume to continue from it, or remove it to start again")
        state = torch.load(args.ckpt, weights_only=True)  # every worker reads rank 0's file; tensors only
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        if rank == 0:
            print(f"resumed from {args.ckpt} at step {step}", flush=True)
    model = shmtrain.DataParallel(net, optimizer, strategy=args.strategy)  # joins the job (rank 0's weights)

    loss_fn = nn.CrossEntropyLoss()
    stream = batches(step)  # the same micro-batches after a resume as in a straight run
    stopped = 0
    while step < args.steps:
        optimizer.zero_grad()
        for micro in range(MICRO_BATCHES):
            x, y = next(stream)
            sync = model.no_sync() if micro < MICRO_BATCHES - 1 else contextlib.nullcontext()
            with sync:  # the first micro-batch only accumulates; the last one communicates
                loss = loss_fn(model(x), y) / MICRO_BATCHES
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()  # DDP-style step: the gradients were averaged when backward() returned
        step += 1
        if rank == 0 and step % args.log_every == 0:
            print(f"step {step} loss {loss.item() * MICRO_BATCHES:.4f}", flush=True)
        stopped = agreed_stop(requested)
        if rank == 0 and args.ckpt is not None and (stopped or step % args.ckpt_every == 0):
            save(args.ckpt, net, optimizer, step)
        if stopped:
            break
    stream.close()  # its DataLoader processes end here
    if rank == 0 and args.ckpt is not None and not stopped:
        save(args.ckpt, net, optimizer, step)
    if rank == 0:
        how = f"stopped by {signal.Signals(stopped).name} after" if stopped else "finished at"
        print(f"{how} step {step}" + (f"; checkpoint {args.ckpt}" if args.ckpt else ""), flush=True)
    dist.barrier()  # rank 0's checkpoint is on disk before any worker leaves
    model.close()  # leaves the process group this script created
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
