"""One Lightning fit of ``shmtrain bench lightning`` (run under torchrun, one process per
rank): an MLP on synthetic data for ``--steps`` optimizer steps with a peer's strategy
(``ddp-gloo``: DDPStrategy on gloo; ``ddp-shm``: DDPStrategy on the ``shm`` backend;
``shmtrain``: ShmtrainStrategy("ssgd")); rank 0 writes the seconds per step after the
warm-up steps and the final weights (flat) to ``--out`` (``torch.save``).

``python -m shmtrain.bench.lightning_fit PEER OUT WIDTH DEPTH BATCH STEPS WARMUP``.
"""

from __future__ import annotations

import os
import sys
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from shmtrain.lightning import ShmtrainStrategy


def model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


class Fit(pl.LightningModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.net = model(width, depth)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class StepClock(pl.Callback):
    """Wall time from the start of step ``warmup`` to the end of the last step."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start = self.end = 0.0

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if trainer.global_step == self.warmup:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.end = time.perf_counter()


def strategy(peer: str) -> pl.strategies.Strategy:
    if peer == "shmtrain":
        return ShmtrainStrategy("ssgd")
    return DDPStrategy(process_group_backend="gloo" if peer == "ddp-gloo" else "shm")


def main(argv: list[str]) -> None:
    peer, out = argv[0], argv[1]
    width, depth, batch, steps, warmup = (int(a) for a in argv[2:7])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    g = torch.Generator().manual_seed(1)
    n = batch * world * steps
    data = TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))
    clock = StepClock(warmup)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy(peer), max_steps=steps, max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[clock])
    fit = Fit(width, depth)
    trainer.fit(fit, DataLoader(data, batch_size=batch))
    if trainer.global_rank == 0:
        params = torch.cat([p.detach().reshape(-1) for p in fit.parameters()])
        torch.save({"step_s": (clock.end - clock.start) / (steps - warmup), "params": params,
                    "numel": params.numel()}, out)


if __name__ == "__main__":
    main(sys.argv[1:])
