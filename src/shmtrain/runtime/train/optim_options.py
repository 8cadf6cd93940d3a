"""Section ``optimisation`` of :class:`shmtrain.runtime.config.TrainConfig`: batch,
optimizer (``runtime/train/optimizers.py``), learning-rate schedule, how long."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shmtrain.runtime.options import need as _need
from shmtrain.runtime.options import option
from shmtrain.runtime.train.optimizers import (
    check_optimizer_options,
    default_momentum,
    optimizer_names,
)
from shmtrain.runtime.train.schedule import Schedule


@dataclass(kw_only=True)
class OptimOptions:
    """Section ``optimisation``: batch, optimizer, learning rate, how long (a mixin, see
    :class:`JobOptions`)."""

    __slots__ = ()

    batch_size: int = option(32, "per worker, the papers' convention", "optim")
    sub_batch: int = option(
        1, "split each worker's batch over K threads (swCaffe Algorithm 1): each computes the "
        "gradient of its batch-size/K samples (sizes differ by at most 1) on a copy of the model "
        "sharing its weights, and the size-weighted mean reaches the strategy as one gradient; "
        "K threads of --threads torch threads each per worker; batch norm normalizes each part "
        "by its own statistics (docs/subbatch.md)", "optim", metavar="K")
    optimizer: str = option(
        "sgd", "any torch.optim class by name, any case: sgd (the papers'), adamw, adam, rmsprop, "
        "... What it means per strategy: docs/optimizers.md", "optim", names=optimizer_names)
    optimizer_args: str = option(
        "", "more keyword arguments of the optimizer, as k=v separated by ';' (Python literals), "
        "e.g. --optimizer-args 'betas=(0.9, 0.95); eps=1e-8'", "optim", metavar="K=V;...")
    lr: float = option(0.05, "learning rate", "optim",
                       default_text="0.05; seasgd and hsgd across hosts 0.2 (docs/choosing_a_method.md, Defaults by "
                       "setting)")
    grad_clip: float | None = option(
        None, "clip the gradient's global L2 norm to this before each optimizer step (the norm "
        "of the gradient the optimizer steps with: averaged, for synchronous strategies)", "optim",
        default_text="no clipping", example=1.0, metavar="NORM")
    accumulate: int = option(
        1, "run each worker's batch as K micro-batches one after the other, their gradients "
        "summed before one exchange and one step (the memory of batch-size/K samples, the "
        "gradient of the whole batch)", "optim", metavar="K")
    amp: Literal["none", "bf16", "fp16"] = option(
        "none", "mixed precision: bf16 runs forward and loss under torch.autocast (bfloat16 "
        "matmuls and convolutions); fp16 the same in float16, with a GradScaler against underflowing "
        "gradients (meant for GPUs; slow on a CPU). Weights, gradients and the shared buffers stay "
        "float32 (docs/gpu.md)", "optim")
    momentum: float | None = option(None, "momentum of an optimizer that takes one (sgd, rmsprop)", "optim",
                                    default_text="0.9 with sgd, else the optimizer's default", example=0.9)
    weight_decay: float = option(1e-4, "L2 weight decay", "optim")
    lr_schedule: Schedule = option(
        "constant", "learning-rate schedule, stepped every iteration: constant; step (times "
        "--lr-gamma every --lr-step-every iterations); cosine (down to --lr-min at the last planned "
        "iteration)", "optim", default_text="constant; seasgd and hsgd across hosts cosine")
    warmup_iterations: int = option(0, "linear warm-up from --lr/(N+1) to --lr over the first N "
                                    "iterations, then the schedule", "optim")
    lr_step_every: int | None = option(None, "step schedule: iterations between decays", "optim",
                                       default_text="a third of the iterations after warm-up",
                                       example=100)
    lr_gamma: float = option(0.1, "step schedule: the factor of each decay", "optim")
    lr_min: float = option(0.0, "cosine schedule: the learning rate it ends at", "optim")
    iterations: int | None = option(None, "iterations per worker", "optim",
                                    default_text="from --epochs", example=100)
    epochs: float | None = option(None, "epochs over the sharded data", "optim",
                                  default_text="20 when --iterations is not given", example=5)
    seed: int = option(0, "makes a run repeatable", "optim")

    def _check_optim(self) -> None:
        _need(self.amp != "fp16" or self.sub_batch == 1, "amp", self.amp, "the --sub-batch threads run "
              "bf16 or float32 only (no GradScaler)", "use --amp bf16 with --sub-batch, or --sub-batch 1")
        _need(self.batch_size >= 1, "batch-size", self.batch_size, "the batch size per worker must be positive",
              "use e.g. --batch-size 32")
        _need(self.sub_batch >= 1, "sub-batch", self.sub_batch, "the batch is split over K threads, "
              "so K must be at least 1", "use --sub-batch 1 for one thread")
        _need(self.sub_batch <= self.batch_size, "sub-batch", self.sub_batch,
              f"each of the K threads needs at least 1 of the --batch-size {self.batch_size} samples",
              f"use --sub-batch {self.batch_size} or less, or a larger --batch-size")
        _need(self.lr > 0, "lr", self.lr, "the learning rate must be positive", "use e.g. --lr 0.05")
        _need(self.momentum is None or 0 <= self.momentum < 1, "momentum", self.momentum, "momentum must be in [0, 1)",
              "use e.g. --momentum 0.9")
        _need(self.grad_clip is None or self.grad_clip > 0, "grad-clip", self.grad_clip,
              "the norm to clip to must be positive", "use e.g. --grad-clip 1.0, or leave it out")
        _need(self.accumulate >= 1, "accumulate", self.accumulate, "K micro-batches, at least 1",
              "use --accumulate 1 for one pass per batch")
        _need(self.accumulate <= self.batch_size, "accumulate", self.accumulate,
              f"each of the K micro-batches needs at least 1 of the --batch-size {self.batch_size} samples",
              f"use --accumulate {self.batch_size} or less, or a larger --batch-size")
        _need(self.accumulate == 1 or self.sub_batch == 1, "accumulate", self.accumulate,
              f"micro-batches one after the other and --sub-batch {self.sub_batch} threads do not combine",
              "drop one of them")
        _need(self.weight_decay >= 0, "weight-decay", self.weight_decay, "weight decay must not be negative",
              "use 0 to turn it off")
        _need(self.iterations is None or self.iterations >= 1, "iterations", self.iterations, "must be at least 1",
              "use e.g. --iterations 100")
        _need(self.epochs is None or self.epochs > 0, "epochs", self.epochs, "must be positive", "use e.g. --epochs 5")
        _need(self.warmup_iterations >= 0, "warmup-iterations", self.warmup_iterations, "must not be negative",
              "use 0 for no warm-up")
        _need(self.iterations is None or self.warmup_iterations < self.iterations, "warmup-iterations",
              self.warmup_iterations, f"the warm-up must end before the last of --iterations {self.iterations}",
              "give fewer warm-up iterations than --iterations")
        _need(self.lr_step_every is None or self.lr_step_every >= 1, "lr-step-every", self.lr_step_every,
              "must be at least 1", "use e.g. --lr-step-every 100")
        _need(0 < self.lr_gamma <= 1, "lr-gamma", self.lr_gamma, "the decay factor must be in (0, 1]",
              "use e.g. --lr-gamma 0.1")
        _need(0 <= self.lr_min <= self.lr, "lr-min", self.lr_min, f"must be in [0, --lr {self.lr}]",
              "use e.g. --lr-min 0")
        for flag, value, given, schedule in (("lr-step-every", self.lr_step_every, self.lr_step_every is not None,
                                              "step"),
                                             ("lr-gamma", self.lr_gamma, self.lr_gamma != 0.1, "step"),
                                             ("lr-min", self.lr_min, self.lr_min != 0.0, "cosine")):
            _need(not given or self.lr_schedule == schedule, flag, value,
                  f"applies to --lr-schedule {schedule} only, not {self.lr_schedule}",
                  f"add --lr-schedule {schedule}, or leave --{flag} out")
        if self.iterations is not None and self.epochs is not None:
            raise ValueError(
                f"--iterations {self.iterations} and --epochs {self.epochs} both given; a run "
                "is measured in one of them: drop one"
            )
        # last: the flags' own rules name them before the optimizer's constructor would
        check_optimizer_options(self.optimizer, self.optimizer_args, self.momentum, self.weight_decay)
        if self.momentum is None:  # the value the optimizer will use, so config.toml records it
            self.momentum = default_momentum(self.optimizer)
