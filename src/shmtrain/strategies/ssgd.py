"""Synchronous SGD with gradient averaging by allreduce (the MPICaffe baseline of ShmCaffe).

Every worker computes the gradient of its own mini-batch, the gradients are averaged
over all workers (ShmCaffe Section IV-C, "MPICaffe"; SHM-Learn-Dist eq. 2.1 without
a server), and every worker applies the same update, so the weights stay identical
and equal to single-process SGD on the union of the workers' batches.

The allreduce comes from the strategy's transports (``--allreduce``: ``shm`` by default).
With ``shm``, gradients go straight into this worker's slot of the shared-memory
allreduce (``param.grad`` are views of it); after the reduction ``param.grad`` are
re-pointed at the shared result, which the optimizer reads in place. ``--overlap`` is
run by :class:`shmtrain.strategies.ssgd_overlap.OverlapSSGD` (``implementation``),
``--sharded-update`` (ZeRO-1 inside a host, issue 16 item 4) by
:class:`shmtrain.strategies.ssgd_sharded.ShardedSSGD`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from shmtrain.fabric.flat import FlatLayout, broadcast_parameters
from shmtrain.strategies.base import Strategy, StrategyConfig, register
from shmtrain.strategies.slots import CastSlotGradients, SlotGradients
from shmtrain.strategies.ssgd_nccl import NcclSSGD
from shmtrain.strategies.ssgd_overlap import OverlapSSGD
from shmtrain.strategies.ssgd_sharded import ShardedSSGD

AllreduceName = Literal["shm", "gloo", "ring", "rhd", "tree", "topo", "hierarchical", "auto", "nccl"]


@register
class SSGD(SlotGradients, Strategy):
    """Synchronous SGD, gradient averaging through the shared-memory allreduce."""

    name = "ssgd"
    #: the allreduce's dtype when it is not the parameters' (CastSSGD)
    comm_dtype: torch.dtype | None = None

    @dataclass(kw_only=True, slots=True)
    class Config(StrategyConfig):
        #: allreduce algorithm: "shm" (shared memory in a host, gloo among hosts) or one of
        #: shmtrain.fabric.collectives (ring, rhd, tree, topo, hierarchical, gloo, auto), or
        #: "nccl" on GPUs, one per worker (the DDP baseline: shmtrain.strategies.ssgd_nccl)
        allreduce: AllreduceName = "shm"
        #: start the allreduce bucket by bucket from gradient hooks during backward, the
        #: DDP way (implemented in shmtrain.strategies.ssgd_overlap; docs/overlap.md)
        overlap: bool = False
        #: bucket size cap in MiB for --overlap (the first bucket is at most 1 MiB)
        bucket_mb: float = 25.0
        #: ZeRO-1 inside a host: weights in shared memory, each local rank updates its chunk
        #: with momentum for that chunk only (shmtrain.strategies.ssgd_sharded; docs/overlap.md)
        sharded_update: bool = field(default=False, metadata={
            "help": "ZeRO-1 inside a host: weights in shared memory, each local rank runs SGD "
                    "on its chunk with momentum for that chunk only (docs/overlap.md)"})
        #: the dtype gradients are averaged in: fp32, or bf16 (half the bytes in the slots
        #: and between hosts; weights, optimizer and gradients stay float32)
        comm_dtype: Literal["fp32", "bf16"] = field(default="fp32", metadata={
            "help": "dtype of the gradient allreduce: fp32, or bf16 (half the bytes moved, in the "
                    "slots and between hosts; the weights and the optimizer stay float32; docs/collectives.md)"})

        def __post_init__(self) -> None:
            from shmtrain.fabric.collectives.reducers import check_name

            if self.allreduce == "nccl":
                others = [flag for flag, on in (("--overlap", self.overlap), ("--sharded-update", self.sharded_update),
                                                (f"--comm-dtype {self.comm_dtype}", self.comm_dtype != "fp32")) if on]
                if others:
                    raise ValueError(
                        f"--allreduce nccl with {others[0]}: the NCCL baseline is one allreduce of "
                        f"the float32 gradients after backward, as DDP's; drop {others[0]} or use "
                        "--allreduce shm")
            else:
                check_name(self.allreduce)
            if not self.bucket_mb > 0:
                raise ValueError(
                    f"--bucket-mb {self.bucket_mb}: the bucket size must be positive; "
                    "use e.g. --bucket-mb 25 (PyTorch DDP's default)"
                )
            if self.overlap and self.allreduce not in ("shm", "gloo"):
                raise ValueError(
                    f"--allreduce {self.allreduce!r} with --overlap: overlapped buckets go "
                    "through shared memory or gloo only; use --allreduce shm or gloo, or drop --overlap"
                )
            if self.sharded_update and (self.overlap or self.allreduce != "shm"):
                chosen = "--overlap" if self.overlap else f"--allreduce {self.allreduce!r}"
                raise ValueError(
                    f"--sharded-update with {chosen}: the sharded update follows the "
                    "shared-memory allreduce (each rank updates the chunk it reduced); use "
                    "--allreduce shm without --overlap, or drop --sharded-update"
                )

            if self.comm_dtype != "fp32" and (self.overlap or self.sharded_update):
                chosen = "--overlap" if self.overlap else "--sharded-update"
                raise ValueError(
                    f"--comm-dtype {self.comm_dtype} with {chosen}: the narrower allreduce is built "
                    f"for plain ssgd only; drop {chosen}, or use --comm-dtype fp32")

    @classmethod
    def implementation(cls, config: StrategyConfig) -> type[Strategy]:
        if getattr(config, "allreduce", "") == "nccl":
            return NcclSSGD
        if getattr(config, "sharded_update", False):
            return ShardedSSGD
        if getattr(config, "comm_dtype", "fp32") == "bf16":
            return CastSSGD
        return OverlapSSGD if getattr(config, "overlap", False) else cls

    def __init__(self, config, ctx, model, optimizer, timer=None, *, transports=None) -> None:
        super().__init__(config, ctx, model, optimizer, timer, transports=transports)
        self.layout = FlatLayout(self.params)
        broadcast_parameters(self.layout)
        self.allreduce = self.transports.allreduce(
            config.allreduce, self.layout.numel, self.comm_dtype or self.layout.dtype, op="mean", tag="grads"
        )
        self.bind_slots()


class CastSSGD(CastSlotGradients, SSGD):
    """``ssgd --comm-dtype bf16``: the gradients averaged in bfloat16 (issue 14 item 4)."""

    comm_dtype = torch.bfloat16
