"""One training, two ways (run by tests/lightning/): Lightning's Trainer with a strategy,
or the same method through ``shmtrain.DataParallel`` in a plain loop under torchrun.

``python lightning_script.py MODE OUT [JSON]``; MODE ``lightning`` (Lightning's own
launcher starts the other ranks: this script again; or under torchrun, ``workers`` per
host of ``nodes``), ``plain`` (under torchrun), JSON the
run's settings (:data:`DEFAULTS`). Rank 0 writes ``OUT`` (``torch.save``): the final
parameters (flat), and what the run saw (``OUT.json``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

DEFAULTS = {
    "method": "ssgd", "options": {}, "backend": "gloo", "strategy": "shmtrain", "epochs": 2, "batch": 8,
    "samples": 128, "lr": 0.05, "momentum": 0.9, "sync_dist": False, "workers": 2, "ckpt_dir": None,
    "resume": None, "log_dir": None, "log_every": 2, "nodes": 1,
}


def data(samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(samples, 12, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + (x[:, 4:8].sum(1) > 0).long()
    return TensorDataset(x, y)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))


def accuracy(module: nn.Module, samples: int, params: torch.Tensor | None = None) -> float:
    """The fraction of the training set ``module`` classifies right (with ``params``, flat, in
    place of its own)."""
    model = net()
    model.load_state_dict({k.removeprefix("net."): v for k, v in module.state_dict().items()})
    if params is not None:
        torch.nn.utils.vector_to_parameters(params, model.parameters())
    x, y = data(samples).tensors
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def plain(cfg: dict, out: Path) -> None:
    import shmtrain

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])
    dp = shmtrain.DataParallel(model, opt, cfg["method"], **cfg["options"])
    # Lightning's own sampler for training: shuffled, seed 0 (PL_GLOBAL_SEED unset), set_epoch each epoch
    sampler = DistributedSampler(data(cfg["samples"]), num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data(cfg["samples"]), batch_size=cfg["batch"], sampler=sampler)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss_fn(dp(x), y).backward()
            opt.step()
    iteration = dp.iteration
    dp.close()
    state = dp.global_state_dict()
    seen = {"iteration": iteration, "accuracy": accuracy(model, cfg["samples"]),
            "initial_accuracy": accuracy(net(), cfg["samples"])}
    if state is not None:
        centre = torch.cat([state[n].reshape(-1) for n, _ in model.named_parameters()])
        seen["centre_accuracy"] = accuracy(model, cfg["samples"], centre)
    if rank == 0:
        torch.save(flat(model), out)
        Path(f"{out}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


def lightning(cfg: dict, out: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import DDPStrategy

    from shmtrain.lightning import ShmtrainStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net()
            self.loss_fn = nn.CrossEntropyLoss()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = self.loss_fn(self.net(x), y)
            if cfg["sync_dist"]:
                self.log("train_loss", loss, sync_dist=True, on_step=False, on_epoch=True)
                self.log("seen", torch.tensor(x.shape[0]), sync_dist=True, on_step=False, on_epoch=True,
                         reduce_fx="sum")
            return loss

        def on_train_start(self) -> None:  # what the run starts from (after a resume: what it loaded)
            dp = self.trainer.strategy.data_parallel if cfg["strategy"] == "shmtrain" else None
            if dp is not None and self.global_rank == 0:
                torch.save({"strategy": dp.strategy.state_dict(), "params": flat(self)}, f"{out}.start")

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])

    if cfg["strategy"] == "shmtrain":
        strategy = ShmtrainStrategy(cfg["method"], process_group_backend=cfg["backend"], **cfg["options"])
    else:
        strategy = DDPStrategy(process_group_backend=cfg["backend"])
    callbacks = []
    if cfg["ckpt_dir"]:
        callbacks.append(ModelCheckpoint(dirpath=cfg["ckpt_dir"], save_top_k=-1, every_n_epochs=1,
                                         filename="{epoch}"))
    logger = CSVLogger(cfg["log_dir"], name="run") if cfg["log_dir"] else False
    trainer = pl.Trainer(accelerator="cpu", devices=cfg["workers"], num_nodes=cfg["nodes"], strategy=strategy,
                         max_epochs=cfg["epochs"],
                         enable_progress_bar=False, enable_model_summary=False, logger=logger,
                         enable_checkpointing=bool(cfg["ckpt_dir"]), callbacks=callbacks,
                         log_every_n_steps=cfg["log_every"])
    module = Module()
    loader = DataLoader(data(cfg["samples"]), batch_size=cfg["batch"], shuffle=False)
    trainer.fit(module, loader, ckpt_path=cfg["resume"])
    seen = {"global_step": trainer.global_step, "accuracy": accuracy(module, cfg["samples"]),
            "initial_accuracy": accuracy(net(), cfg["samples"]),
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}}
    if isinstance(strategy, ShmtrainStrategy):
        seen["phases"] = strategy.phases.last
        seen["iteration"] = strategy.iteration
        state = strategy.global_state
        if state is not None:
            centre = torch.cat([state[n].reshape(-1) for n, _ in module.named_parameters()])
            seen["centre_accuracy"] = accuracy(module, cfg["samples"], centre)
    if trainer.global_rank == 0:
        torch.save(flat(module), out)
        Path(f"{out}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    settings = {**DEFAULTS, **(json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})}
    {"plain": plain, "lightning": lightning}[mode](settings, out)
    # done: end without the interpreter's teardown, where torch 2.14 can abort a gloo job that
    # made an optimizer, with or without shmtrain (tests/support/script_exit.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
