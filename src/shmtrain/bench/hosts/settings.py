"""The written-down ``bench hosts`` comparisons: each method's ``shmtrain train`` flags
(:data:`METHODS`), the defaults, and :data:`SETTINGS` (``mlp-100mbit``,
``resnet18-1gbit``) with each method's own grid. :mod:`shmtrain.bench.hosts.command` says what
each method is and how a comparison is run and read; docs/choosing_a_method.md has the
pilots each grid comes from."""

from __future__ import annotations

from typing import Any

#: method -> the ``shmtrain train`` flags that choose it (None: the DDP script); everything
#: else is the method's defaults, which the job's setting picks (``runtime/defaults.py``)
METHODS: dict[str, list[str] | None] = {
    "ssgd": ["--strategy", "ssgd", "--allreduce", "shm"],
    "hsgd": ["--strategy", "hsgd", "--groups", "2", "--group-size", "2"],
    "seasgd": ["--strategy", "seasgd"],
    "diloco": ["--strategy", "diloco"],
    "hybrid": ["--strategy", "diloco", "--inner", "host-sync"],
    "diloco-topk": ["--strategy", "diloco", "--compress", "topk:0.01,bits:4"],
    "hybrid-topk": ["--strategy", "diloco", "--inner", "host-sync", "--compress", "topk:0.01,bits:4"],
    "seasgd-topk": ["--strategy", "seasgd", "--compress", "topk:0.1,bits:4"],
    "hsgd-topk": ["--strategy", "hsgd", "--groups", "2", "--group-size", "2", "--compress", "topk:0.1,bits:4"],
    "ddp": None,
    # not in the default set: ssgd averaging its gradients in bfloat16 (half the bytes on the link)
    "ssgd-bf16": ["--strategy", "ssgd", "--allreduce", "shm", "--comm-dtype", "bf16"],
    # not in the default set: Caffe-MPI's star (rank 0 averages the gradients, updates, broadcasts)
    "ps_grad": ["--strategy", "ps_grad"],
    # ssgd on host a alone, with host a's shard: what one host reaches without the other
    "one-host": ["--strategy", "ssgd", "--allreduce", "shm"],
}
#: the method that runs on one host (its job has one node)
ONE_HOST = "one-host"
#: the methods of a run without --methods or --setting
DEFAULT_METHODS = ["ssgd", "hsgd", "seasgd", "ddp"]
DEFAULTS: dict[str, Any] = {"model": "wide_mlp", "data": "digits", "batch_size": 32, "lr": 0.05, "iterations": 400,
                            "eval_every": 10, "target": 0.95, "seed": 0, "class_split": 0}
#: the quick variant (the tests run it): a few iterations, a target every method reaches
QUICK = {"iterations": 30, "eval_every": 5, "target": 0.3, "lr": 0.1}
#: a grid point of DiLoCo or the hybrid: inner lr, H, the outer gradient in bfloat16, the
#: outer lr (DiLoCo's 0.7, given: the default follows the inner optimizer) and the outer
#: Nesterov momentum (the paper's 0.9 oscillates on a class split; 0.8 settles)
def _outer(lr: float, sync_every: int, momentum: float = 0.8) -> dict[str, Any]:
    return {**_topk(lr, sync_every, momentum), "outer_dtype": "bf16"}


#: the same point for the compressed methods (their values are quantised by --compress,
#: which refuses --outer-dtype bf16 beside it)
def _topk(lr: float, sync_every: int, momentum: float = 0.8) -> dict[str, Any]:
    return {"lr": lr, "sync_every": sync_every, "outer_lr": 0.7, "outer_momentum": momentum}


#: a compressed method's point on ResNet-18: the hosts' models averaged every H steps (outer
#: lr 1, no outer momentum). Pilots (docs/choosing_a_method.md): at lr 0.003, DDP's best, 50
#: iterations to 90% at H 2 and 70 at H 4; the outer Nesterov step (0.7, 0.8) needed 150 at H 4
def _average(lr: float, sync_every: int) -> dict[str, Any]:
    return {"lr": lr, "sync_every": sync_every, "outer_lr": 1.0, "outer_momentum": 0.0}


#: the grid points of seasgd-topk and hsgd-topk: moving rate 0.5 at lr 0.1 and 0.2, then lr
#: 0.2 decayed to 0 by cosine
def _elastic_topk() -> list[dict[str, Any]]:
    return [{"lr": 0.1, "moving_rate": 0.5, "lr_schedule": "constant"},
            {"lr": 0.2, "moving_rate": 0.5, "lr_schedule": "constant"},
            {"lr": 0.2, "moving_rate": 0.5, "lr_schedule": "cosine"}]


#: the grid points of seasgd and hsgd: lr, then lr exchanging every 10 iterations, then
#: the higher lr exchanging every 10
def _exchange(lr: float, higher: float) -> list[dict[str, Any]]:
    return [{"lr": lr}, {"lr": lr, "update_interval": 10}, {"lr": higher, "update_interval": 10}]


#: the written-down comparisons: every method, the one-host run, a per-host
#: class split, and each method's grid: its own hyper-parameters, the same number of
#: points (trial runs) for every method. ``*``: the methods without their own (lr only).
SETTINGS: dict[str, dict[str, Any]] = {
    "mlp-100mbit": {"model": "wide_mlp", "data": "digits", "rate": "100mbit", "batch_size": 32, "iterations": 400,
                    "eval_every": 10, "target": 0.9, "class_split": 2,
                    "grid": {"*": [{"lr": 0.02}, {"lr": 0.05}, {"lr": 0.1}],
                             "diloco": [_outer(0.05, 20), _outer(0.05, 10), _outer(0.02, 10)],
                             "hybrid": [_outer(0.1, 10), _outer(0.05, 10), _outer(0.05, 20)],
                             # pilots (docs/choosing_a_method.md): H 8-10, outer momentum 0.5-0.8
                             "diloco-topk": [_topk(0.05, 8, 0.6), _topk(0.05, 10, 0.5), _topk(0.05, 8, 0.5)],
                             "hybrid-topk": [_topk(0.05, 8), _topk(0.05, 10), _topk(0.05, 6)],
                             "seasgd": _exchange(0.05, 0.1), "hsgd": _exchange(0.05, 0.1),
                             # a constant step keeps W_g swinging between the hosts' classes to the end:
                             # the third point decays it (docs/choosing_a_method.md)
                             "seasgd-topk": _elastic_topk(), "hsgd-topk": _elastic_topk()},
                    "methods": ["ssgd", "hsgd", "seasgd", "diloco", "hybrid", "diloco-topk", "hybrid-topk", "ddp",
                                ONE_HOST]},
    "resnet18-1gbit": {"model": "shmtrain.bench.hosts.models:resnet18_gn_upscaled", "data": "digits",
                       "rate": "1gbit", "batch_size": 8, "iterations": 150, "eval_every": 10, "target": 0.9,
                       "class_split": 2, "preload": "torchvision",
                       "grid": {"*": [{"lr": 0.003}, {"lr": 0.01}, {"lr": 0.03}],
                                "diloco": [_outer(0.01, 20), _outer(0.01, 10), _outer(0.03, 10)],
                                "hybrid": [_outer(0.03, 10), _outer(0.01, 10), _outer(0.01, 20)],
                                "diloco-topk": [_average(0.003, 2), _average(0.003, 4), _average(0.005, 2)],
                                "hybrid-topk": [_average(0.003, 2), _average(0.003, 4), _average(0.005, 2)],
                                "seasgd": _exchange(0.01, 0.03), "hsgd": _exchange(0.01, 0.03)},
                       "methods": ["ssgd", "hsgd", "seasgd", "diloco", "hybrid", "diloco-topk", "hybrid-topk", "ddp",
                                   ONE_HOST]},
}
