"""AUTOTUNE: try every candidate allreduce during the first calls, keep the fastest.

swCaffe Section VI-A runs the first iterations with each convolution plan and keeps
the best for the rest of the run; here the candidates are allreduce algorithms.
Calls ``1 .. C*trials`` cycle through the ``C`` candidates (each call is a real,
correct allreduce of that step's gradients, so training is not disturbed). Each trial
starts after a barrier, so a rank's time is the collective's and not its wait for a
slower peer's backward pass. Before the trials, each candidate runs once per buffer
parity at construction, on the zeroed buffers, so first-touch costs (page faults,
peers' shared pages, gloo's first messages) stay out of the trials. Then every rank
takes its best time per candidate, the
ranks agree on the maximum over ranks of those (one ``all_reduce(MAX)``), and all pick
the same winner, the candidate with the smallest agreed time.

All candidates reduce the same two buffers, so the strategy binds its views once.
With ``shm`` among the candidates those buffers are this worker's shared-memory
slots; a step run by ``shm`` then copies the stitched result into the slot (one
extra copy of n elements, which the measurement includes).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from shmtrain.fabric.allreduce.collectives.reducers import (
    GlooAllreduce,
    Op,
    ScheduledAllreduce,
    TwoBuffers,
    host_topology,
)
from shmtrain.fabric.allreduce.collectives.transport import GlooTransport

#: calls per candidate at construction, one per buffer parity, on the zeroed buffers: the
#: first touch of each buffer (page faults, peers' shared pages, gloo's first messages)
#: then happens before the trials instead of in them
WARMUP_CALLS = 2


def default_candidates(ctx) -> tuple[str, ...]:
    """Candidates that differ on this job: topo and hierarchical need several hosts
    (on one host topo is rhd and hierarchical is tree)."""
    names = ("shm", "gloo", "ring", "rhd", "tree")
    if ctx.num_nodes > 1:
        names += ("topo", "hierarchical")
    return names


class _ShmCandidate:
    """The shared-memory allreduce run at a given step, result copied into the slot.

    Its sequence numbers run ``WARMUP_CALLS`` ahead of our steps (same parity, so the
    same slot set), leaving room for the warm-up calls.
    """

    def __init__(self, shm) -> None:
        self.shm = shm

    def reduce_step(self, step: int) -> torch.Tensor:
        return self.run(step + WARMUP_CALLS)

    def run(self, sequence: int) -> torch.Tensor:
        shm = self.shm
        shm.count = sequence - 1  # its slot set and sequence numbers follow ours
        result = shm()
        own = shm.input(sequence)
        me = shm.host.local_rank
        # Safe: every rank has finished reducing this step; slot sets alternate by parity.
        for j, (lo, hi) in enumerate(shm.chunks):
            if j != me and hi > lo:
                own[lo:hi].copy_(result[lo:hi])
        return own


class AutotunedAllreduce(TwoBuffers):  # input()/result() over self.buffers
    """``--allreduce auto``: the interface of :class:`ShmAllreduce`, tuned at run time.

    Attributes:
        candidates: the names tried, in order.
        measurements: seconds of each trial on this rank, by name.
        agreed: per name, the maximum over ranks of each rank's best trial.
        choice: the winner (None until the trials are over).
    """

    def __init__(
        self,
        ctx,
        numel: int,
        dtype: torch.dtype,
        op: Op,
        candidates: tuple[str, ...],
        *,
        trials: int = 2,
        tag: str = "collective",
        verbose: bool = True,
        warmup: bool = True,
    ) -> None:
        if trials < 1:
            raise ValueError(f"autotune trials {trials} must be at least 1")
        if not candidates:
            raise ValueError("--allreduce auto needs at least one candidate")
        self.ctx = ctx
        self.trials = trials
        self.verbose = verbose
        self.candidates = tuple(candidates)
        self._impl = {}
        buffers = None
        if "shm" in self.candidates:
            from shmtrain.fabric.allreduce.shared import ShmAllreduce

            shm = ShmAllreduce(
                ctx.host, numel, dtype=dtype, op=op, leaders=ctx.leaders, tag=f"{tag}.auto"
            )
            buffers = (shm.input(0), shm.input(1))
            self._impl["shm"] = _ShmCandidate(shm)
        else:
            buffers = (torch.zeros(numel, dtype=dtype), torch.zeros(numel, dtype=dtype))
        self.buffers = buffers
        transport = None
        for name in self.candidates:
            if name == "gloo":
                self._impl[name] = GlooAllreduce(numel, dtype, op=op, buffers=buffers)
            elif name != "shm":
                transport = transport or GlooTransport(timeout=ctx.timeout)
                self._impl[name] = ScheduledAllreduce(
                    name, transport, numel, dtype, op=op, topology=host_topology(ctx),
                    buffers=buffers,
                )
        self.measurements: dict[str, list[float]] = {name: [] for name in self.candidates}
        self.agreed: dict[str, float] = {}
        self.choice: str | None = None
        self.count = 0
        if len(self.candidates) == 1:
            self.choice = self.candidates[0]
        elif warmup:
            for name in self.candidates:
                impl = self._impl[name]
                for sequence in range(1, WARMUP_CALLS + 1):
                    if name == "shm":
                        impl.run(sequence)
                    else:
                        impl.reduce_step(sequence)

    def __call__(self) -> torch.Tensor:
        self.count += 1
        step = self.count
        if self.choice is not None:
            return self._impl[self.choice].reduce_step(step)
        name = self.candidates[(step - 1) % len(self.candidates)]
        if self.ctx.world_size > 1:
            dist.barrier()
        start = time.perf_counter()
        out = self._impl[name].reduce_step(step)
        self.measurements[name].append(time.perf_counter() - start)
        if step == len(self.candidates) * self.trials:
            self._decide()
        return out

    def close(self) -> None:
        """Release the shared-memory candidate's segment (buffers unusable afterwards)."""
        shm = self._impl.get("shm")
        if shm is not None:
            shm.shm.close()
        self.buffers = ()

    def _decide(self) -> None:
        best = torch.tensor([min(self.measurements[n]) for n in self.candidates], dtype=torch.float64)
        if self.ctx.world_size > 1:
            dist.all_reduce(best, op=dist.ReduceOp.MAX)
        self.agreed = dict(zip(self.candidates, best.tolist(), strict=True))
        self.choice = self.candidates[int(torch.argmin(best))]
        if self.verbose and self.ctx.rank == 0:
            table = ", ".join(f"{n} {s * 1e3:.3f} ms" for n, s in self.agreed.items())
            print(
                f"shmtrain: --allreduce auto: best of {self.trials} trials (max over ranks): "
                f"{table}; chose {self.choice}",
                flush=True,
            )
