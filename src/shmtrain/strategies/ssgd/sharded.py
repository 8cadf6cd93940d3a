"""``ssgd --sharded-update``: ZeRO-1 inside a host, the optimizer sharded over local ranks.

The weights live once per host, in a shared-memory segment that every
local rank maps (the model's parameters are views of it). After the shared-memory
reduction (:class:`shmtrain.fabric.allreduce.shared.ShmAllreduce`; across hosts its
leaders allreduce the host sums first, so each host holds the global mean), local rank
``r`` applies SGD to chunk ``r`` of the flat parameters only -- the same chunk it just
reduced, still in its own slot and in cache -- with momentum buffers for that chunk
only: gradients are read once, parameters written once, and optimizer memory per worker
is divided by the local world size (PAR-SUM's split, swCaffe Section V-A, applied to the
update as ZeRO stage 1 does). Every rank then posts "updated" (a futex-backed sequence
word of the control block) and sleeps until all chunks are updated, before the next
forward reads the weights.

Only ``torch.optim.SGD`` is run (momentum, dampening, weight decay, Nesterov; every
group's ``lr`` is read at each step, so schedulers still apply): the update is
elementwise, so a chunk's update is exactly the optimizer's on those elements. The
optimizer object itself never steps; its ``state`` stays empty and each rank's momentum
chunk is in :meth:`ShardedSSGD.state_dict`.
"""

from __future__ import annotations

from typing import Any

import torch

from shmtrain.fabric.exchanges.weights import broadcast_parameters
from shmtrain.strategies.base import Strategy
from shmtrain.strategies.layout.flat import FlatLayout
from shmtrain.strategies.optim import step_journal
from shmtrain.strategies.optim.step_journal import StepJournal
from shmtrain.strategies.parts import SlotGradients


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer the sharded update cannot run exactly."""
    if type(optimizer) is not torch.optim.SGD:
        raise ValueError(
            f"--sharded-update runs torch.optim.SGD only (with momentum, dampening, weight "
            f"decay, Nesterov), but the optimizer is {type(optimizer).__name__}; use "
            "torch.optim.SGD or drop --sharded-update (sharded_update=False)"
        )
    for group in optimizer.param_groups:
        if group.get("maximize") or group.get("differentiable"):
            raise ValueError(
                "--sharded-update: SGD with maximize=True or differentiable=True is not "
                "supported; use plain SGD or drop --sharded-update"
            )


class ShardedSSGD(SlotGradients, Strategy):
    """Synchronous SGD whose update is sharded over the host's workers (not registered:
    ``ssgd`` hands a config with ``sharded_update`` to it, see ``SSGD.implementation``)."""

    name = "ssgd"
    synchronous = True
    fp16_reason = ("the sharded update runs SGD's formulas on chunks of host memory, not the optimizer a "
                   "GradScaler steps")
    devices = frozenset({"cpu"})
    optimizers = frozenset({"sgd"})
    grad_clip_reason = ("each rank updates its chunk of the weights from its chunk of the shared mean, "
                        "so no rank holds the whole gradient's norm")
    allreduces = ("shm",)
    #: a worker killed on one host is replaced in place: every rank journals its chunk of the
    #: weights and its momentum after each update, before it posts "updated"
    recovery = "replica"
    variant_reason = ("the sharded update follows the shared-memory allreduce (each rank updates "
                      "the chunk it reduced)")

    @classmethod
    def device_refusal(cls, found: list[str]) -> str:
        return (
            f"--sharded-update keeps the host's one copy of the weights in shared memory and "
            f"updates it on the CPU, but the model is on {found[0]}; drop --sharded-update "
            "(plain ssgd stages its gradients through host memory) or use --device cpu")

    def __init__(self, config, ctx, model, optimizer, timer=None, *, transports=None) -> None:
        super().__init__(config, ctx, model, optimizer, timer, transports=transports)
        check_optimizer(optimizer)
        self.layout = layout = FlatLayout(self.params)
        broadcast_parameters(layout)
        itemsize = torch.empty((), dtype=layout.dtype).element_size()
        initial = layout.gather()

        def init(segment) -> None:
            segment.tensor(layout.dtype, 0, layout.numel).copy_(initial)

        # the host's one copy of the weights; the model's parameters become views of it
        self.segment = self.transports.segment("weights", layout.numel * itemsize, init)
        self.weights = self.segment.tensor(layout.dtype, 0, layout.numel)
        layout.bind_data(self.weights, copy=False)
        self.allreduce = self.transports.allreduce(
            "shm", layout.numel, layout.dtype, op="mean", tag="grads"
        )
        self.lo, self.hi = self.allreduce.chunks[ctx.local_rank]
        self._runs = self._group_runs(optimizer)
        #: momentum of this rank's chunk only (None until the first step, as in SGD)
        self.momentum: torch.Tensor | None = None
        self._updated = self.transports.channel("grads.updated")
        self.bind_slots()
        #: recovery in place: the launch folder of every rank's journal, and this rank's writer
        self._journal_folder: Any = None
        self._journal: StepJournal | None = None

    def _group_runs(self, optimizer: torch.optim.Optimizer) -> list[tuple[int, int, dict]]:
        """Contiguous ranges of this rank's chunk, relative to the chunk, with their group."""
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        runs: list[tuple[int, int, dict]] = []
        for p, (a, b) in zip(self.params, self.layout.offsets, strict=True):
            if id(p) not in group_of:
                raise ValueError(
                    f"--sharded-update: a trainable parameter of shape {tuple(p.shape)} is in no "
                    "parameter group of the optimizer; give the optimizer model.parameters()"
                )
            a, b = max(a, self.lo), min(b, self.hi)
            if a >= b:
                continue
            group = group_of[id(p)]
            if runs and runs[-1][2] is group and runs[-1][1] == a - self.lo:
                runs[-1] = (runs[-1][0], b - self.lo, group)
            else:
                runs.append((a - self.lo, b - self.lo, group))
        return runs

    def apply_update(self) -> None:
        """SGD on this rank's chunk (torch.optim.SGD's formulas), then wait for every chunk."""
        step = self.allreduce.count
        grads = self.allreduce.slots[step % 2][self.ctx.local_rank][self.lo : self.hi]
        weights = self.weights[self.lo : self.hi]
        first = self.momentum is None
        if first and any(g["momentum"] != 0 for _, _, g in self._runs):
            self.momentum = torch.empty_like(grads)
        with torch.no_grad():
            for a, b, group in self._runs:
                self._update(weights[a:b], grads[a:b], a, b, group, first)
        if self._journal is not None:  # recovery in place: before any rank can complete the step
            self._write_chunk(self.iteration + 1)
        control = self.transports.control()
        control.post(self._updated, self.ctx.local_rank, step)
        with self.timer.phase("update_wait"):  # inside "update": not added to "comm"
            control.wait(self._updated, range(self.ctx.local_world), step, timeout=self.ctx.timeout,
                         what="sharded update")

    def _update(self, p: torch.Tensor, g: torch.Tensor, a: int, b: int, group: dict, first: bool) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        mu, damp, nesterov = group["momentum"], group["dampening"], group["nesterov"]
        if mu == 0:
            d_p = g.add(p, alpha=wd) if wd != 0 else g
            p.add_(d_p, alpha=-lr)
            return
        buf = self.momentum[a:b]  # type: ignore[index]
        if first:
            buf.copy_(g)
            if wd != 0:
                buf.add_(p, alpha=wd)
        else:
            buf.mul_(mu).add_(g, alpha=1 - damp)
            if wd != 0:
                buf.add_(p, alpha=wd * (1 - damp))
        if nesterov:
            d_p = g.add(p, alpha=wd) if wd != 0 else g.clone()
            p.add_(d_p.add_(buf, alpha=mu), alpha=-lr)
        else:
            p.add_(buf, alpha=-lr)

    # -- recovery in place --------------------------------------------------------
    def _prefix(self, local_rank: int) -> str:
        return f"step-journal-r{local_rank}"

    def _write_chunk(self, step: int) -> None:
        named = [("weights", self.weights[self.lo : self.hi])]
        if self.momentum is not None:
            named.append(("momentum", self.momentum))
        assert self._journal is not None
        self._journal.write_entries(step, named)

    def prepare_recovery(self, folder) -> None:
        """Every rank journals its chunk (its weights and momentum) after each update, in
        ``folder`` (one host: across hosts a death restarts every worker)."""
        self._journal_folder = folder
        if self.ctx.num_nodes == 1 and self._journal is None:
            self._journal = StepJournal(folder, [], [], None, prefix=self._prefix(self.ctx.local_rank))
            self._write_chunk(self.iteration)

    def _chunk(self, local_rank: int, step: int, folder: Any = None) -> dict[str, torch.Tensor] | None:
        found = step_journal.read(folder or self._journal_folder, step, self._prefix(local_rank))
        return None if found is None else found[0]

    def recovery_state(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """This rank's kept ``state`` with the host's weights after its last whole step,
        chunk by chunk from every rank's journal (a death mid-update leaves the shared
        weights part updated), and its own momentum; None where a chunk is missing."""
        if self._journal_folder is None or self.ctx.num_nodes != 1:
            return None
        step = int(state["train"]["iteration"])
        flat = torch.empty_like(self.weights)  # every element comes from a rank's chunk below
        for rank, (lo, hi) in enumerate(self.allreduce.chunks):
            chunk = self._chunk(rank, step)
            if chunk is None:
                return None
            flat[lo:hi] = chunk["weights"]
        names = {id(p): name for name, p in self.model.named_parameters()}
        views = self.layout.views(flat)
        state["model"] = {**state["model"], **{names[id(p)]: v for p, v in zip(self.params, views, strict=True)}}
        return self.adopted_state(state, self._journal_folder)

    def adopted_state(self, state: dict[str, Any], folder: Any) -> dict[str, Any]:
        """``state`` with this rank's own momentum chunk after the state's step (a donor's
        state holds the donor's chunk), from this rank's journal."""
        if folder is None or self.ctx.num_nodes != 1:
            return state
        chunk = self._chunk(self.ctx.local_rank, int(state["train"]["iteration"]), folder)
        if chunk is None:
            raise ValueError(f"--sharded-update: rank {self.ctx.rank} has no journal of its chunk after step "
                             f"{state['train']['iteration']}, which every rank goes on from")
        strategy = dict(state["strategy"], chunk=(self.lo, self.hi), momentum=chunk.get("momentum"))
        return {**state, "strategy": strategy}

    # -- state ------------------------------------------------------------------
    def momentum_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (its momentum chunk)."""
        return 0 if self.momentum is None else self.momentum.numel() * self.momentum.element_size()

    def state_dict(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            "chunk": (self.lo, self.hi),
            "momentum": None if self.momentum is None else self.momentum.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's momentum chunk; collective (a host barrier), because every
        rank has just written the same weights into the shared segment."""
        super().load_state_dict(state)
        chunk = tuple(state.get("chunk", ()))
        if chunk != (self.lo, self.hi):
            raise ValueError(
                f"--sharded-update: the state holds momentum for elements {chunk}, this rank "
                f"updates {(self.lo, self.hi)}; resume with the same number of workers per "
                "host as the run that saved it"
            )
        saved = state.get("momentum")
        self.momentum = None if saved is None else saved.clone()
        self.transports.barrier("sharded-update state load")

    def finish(self) -> None:
        """Give the model private weights again (the shared segment is the fabric's)."""
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        super().finish()
        self.layout.bind_data(self.weights.clone(), copy=False)

