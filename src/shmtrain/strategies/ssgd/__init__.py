"""Synchronous SGD with gradient averaging by allreduce (the MPICaffe baseline of ShmCaffe).

Every worker computes the gradient of its own mini-batch, the gradients are averaged
over all workers (ShmCaffe Section IV-C, "MPICaffe"; SHM-Learn-Dist eq. 2.1 without
a server), and every worker applies the same update, so the weights stay identical
and equal to single-process SGD on the union of the workers' batches.

The allreduce comes from the strategy's transports (``--allreduce``: ``shm`` by default).
With ``shm``, gradients go straight into this worker's slot of the shared-memory
allreduce (``param.grad`` are views of it); after the reduction ``param.grad`` are
re-pointed at the shared result, which the optimizer reads in place. ``--overlap`` is
run by :class:`shmtrain.strategies.ssgd.overlap.OverlapSSGD` (``implementation``),
``--sharded-update`` (ZeRO-1 inside a host) by
:class:`shmtrain.strategies.ssgd.sharded.ShardedSSGD`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

from shmtrain.fabric.allreduce.collectives.reducers import AllreduceChoice
from shmtrain.fabric.exchanges.weights import broadcast_parameters
from shmtrain.strategies.base import Strategy, StrategyConfig, register
from shmtrain.strategies.layout.flat import FlatLayout
from shmtrain.strategies.parts import CastSlotGradients, SlotGradients
from shmtrain.strategies.ssgd.nccl import NcclSSGD
from shmtrain.strategies.ssgd.overlap import OverlapSSGD
from shmtrain.strategies.ssgd.sharded import ShardedSSGD

#: ``--allreduce``: the collectives' choices, and NCCL (the GPU baseline, :mod:`.nccl`)
AllreduceName = Literal[AllreduceChoice, "nccl"]


@register
class SSGD(SlotGradients, Strategy):
    """Synchronous SGD, gradient averaging through the shared-memory allreduce."""

    name = "ssgd"
    synchronous = True
    recovery = "replica"  # the weights change only in the optimizer step, after the allreduce
    #: the allreduce's dtype when it is not the parameters' (CastSSGD)
    comm_dtype: torch.dtype | None = None
    #: a variant's ``--allreduce`` values (None: any) and why it stands alone
    allreduces: ClassVar[tuple[str, ...] | None] = None
    variant_reason: ClassVar[str] = ""

    @dataclass(kw_only=True, slots=True)
    class Config(StrategyConfig):
        #: allreduce algorithm: "shm" (shared memory in a host, gloo among hosts) or one of
        #: shmtrain.fabric.allreduce.collectives (ring, rhd, tree, topo, hierarchical, gloo, auto), or
        #: "nccl" on GPUs, one per worker (the DDP baseline: shmtrain.strategies.ssgd.nccl)
        allreduce: AllreduceName = field(default="shm", metadata={
            "help": "how the gradients are averaged: shm (shared memory in a host, gloo among the hosts' "
                    "leaders), gloo (torch.distributed's), ring, rhd, tree, topo or hierarchical (each over "
                    "gloo point to point), auto (try each in the first iterations and keep the fastest), or "
                    "nccl on GPUs (the DDP baseline) (docs/collectives.md)"})
        #: start the allreduce bucket by bucket from gradient hooks during backward, the
        #: DDP way (implemented in shmtrain.strategies.ssgd.overlap; docs/overlap.md)
        overlap: bool = field(default=False, metadata={
            "help": "start the allreduce bucket by bucket from gradient hooks while backward runs, as DDP "
                    "does, instead of once after it (docs/overlap.md)"})
        #: bucket size cap in MiB for --overlap (the first bucket is at most 1 MiB)
        bucket_mb: float = field(default=25.0, metadata={
            "help": "with --overlap: the largest bucket of gradients in MiB (the first, the last layers', "
                    "is at most 1 MiB, so its allreduce starts early)"})
        #: ZeRO-1 inside a host: weights in shared memory, each local rank updates its chunk
        #: with momentum for that chunk only (shmtrain.strategies.ssgd.sharded; docs/overlap.md)
        sharded_update: bool = field(default=False, metadata={
            "help": "ZeRO-1 inside a host: weights in shared memory, each local rank runs SGD "
                    "on its chunk with momentum for that chunk only (docs/overlap.md)"})
        #: the dtype gradients are averaged in: fp32, or bf16 (half the bytes in the slots
        #: and between hosts; weights, optimizer and gradients stay float32)
        comm_dtype: Literal["fp32", "bf16"] = field(default="fp32", metadata={
            "help": "dtype of the gradient allreduce: fp32, or bf16 (half the bytes moved, in the "
                    "slots and between hosts; the weights and the optimizer stay float32; docs/collectives.md)"})

        def __post_init__(self) -> None:
            from shmtrain.fabric.allreduce.collectives.reducers import check_name

            if self.allreduce != "nccl":
                check_name(self.allreduce)
            if not self.bucket_mb > 0:
                raise ValueError(
                    f"--bucket-mb {self.bucket_mb}: the bucket size must be positive; "
                    "use e.g. --bucket-mb 25 (PyTorch DDP's default)"
                )
            SSGD.check_variants(self)  # at most one variant, on an allreduce it runs on

    @classmethod
    def variants(cls, config: StrategyConfig) -> list[tuple[str, type[Strategy]]]:
        """The variants ``config`` chooses, as (option, class), in the order their
        conflicts are reported: each variant is a class of its own with its own
        ``devices``, ``fp16_reason``, ``allreduces`` and ``variant_reason``."""
        chosen: list[tuple[str, type[Strategy]]] = []
        if getattr(config, "allreduce", "") == "nccl":
            chosen.append(("--allreduce nccl", NcclSSGD))
        if getattr(config, "comm_dtype", "fp32") != "fp32":
            chosen.append((f"--comm-dtype {config.comm_dtype}", CastSSGD))
        if getattr(config, "sharded_update", False):
            chosen.append(("--sharded-update", ShardedSSGD))
        if getattr(config, "overlap", False):
            chosen.append(("--overlap", OverlapSSGD))
        return chosen

    @classmethod
    def check_variants(cls, config: StrategyConfig) -> None:
        """At most one variant, on an ``--allreduce`` it runs on: a ValueError naming both
        options otherwise (the config's own check, made once when it is built)."""
        chosen = cls.variants(config)
        if len(chosen) > 1:
            (first, variant), (second, _) = chosen[:2]
            raise ValueError(f"{first} with {second}: {variant.variant_reason}; drop {second}, "
                             f"or drop {first}")
        if chosen:
            flag, variant = chosen[0]
            allreduce = getattr(config, "allreduce", "shm")
            if variant.allreduces is not None and allreduce not in variant.allreduces:
                choices = " or ".join(variant.allreduces)
                raise ValueError(f"{flag} with --allreduce {allreduce!r}: {variant.variant_reason}; "
                                 f"use --allreduce {choices}, or drop {flag}")

    @classmethod
    def choose(cls, config: StrategyConfig) -> tuple[type[Strategy], str]:
        """The class of the one variant a checked ``config`` chooses (plain :class:`SSGD`
        for none) and the option that chose it."""
        chosen = cls.variants(config)
        return (chosen[0][1], chosen[0][0]) if chosen else (cls, f"--strategy {cls.name}")

    def __init__(self, config, ctx, model, optimizer, timer=None, *, transports=None) -> None:
        super().__init__(config, ctx, model, optimizer, timer, transports=transports)
        self.layout = FlatLayout(self.params)
        broadcast_parameters(self.layout)
        self.allreduce = self.transports.allreduce(
            config.allreduce, self.layout.numel, self.comm_dtype or self.layout.dtype, op="mean", tag="grads"
        )
        self.bind_slots()


class CastSSGD(CastSlotGradients, SSGD):
    """``ssgd --comm-dtype bf16``: the gradients averaged in bfloat16."""

    comm_dtype = torch.bfloat16
    shared_gradients = False  # the mean comes back into a private float32 buffer
    variant_reason = "the narrower allreduce is built for plain ssgd only"
