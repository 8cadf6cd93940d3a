"""A worker's side of replacing a dead peer in place (one host, ``shmtrain train``).

Why the survivors' state is the job's, for the strategies that recover as replicas
(``Strategy.recovery == "replica"``: synchronous SGD, with or without ``--overlap``, on
CPU): every rank applies the same update to the same weights (ShmCaffe Section IV-C's
MPICaffe; SHM-Learn-Dist eq. 2.1), and a rank changes its weights, optimizer and
schedule only in the optimizer step, which starts after the step's allreduce completed
on that rank. A death therefore finds each survivor either before the update of step
``t`` (its state is the state after ``t - 1``; its gradients are dropped) or after it
(the allreduce it completed held every rank's gradient, the dead one's included, so
its state is the state after ``t``). The survivor that completed the most steps holds
the state every rank would have had: all continue from it, the replacement included,
and step ``t`` is computed again by every rank from the same weights and the same
batches (the data position is the step count), so the run's weights stay bit for bit
those of a run that was never killed.

The flow, on a survivor (the launcher's side: ``runtime/launch/replacement.py``):

1. the training loop raises :class:`~shmtrain.fabric.shm.control.PeerFailure` (the
   launcher aborted the control block, or a wait found the peer dead); the session keeps
   this rank's state (:func:`keep`, between steps by the argument above) and unwinds;
2. :func:`rejoin` posts the steps it completed, leaves the job (its process groups),
   waits for the launcher's plan, writes its state for the others when it is the donor,
   joins the next generation of the job (a new control block, fresh keys of the store,
   new segments and gloo group) and returns the state this rank continues from.

This rank's RNG states stay its own (the replacement takes the donor's). A model whose
forward draws random numbers (dropout) therefore repeats step ``t`` with other draws on
the ranks that had drawn for it already; the bit-for-bit argument is for a forward
without randomness.
"""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shmtrain.fabric.job import context as fabric_context
from shmtrain.fabric.job.context import GENERATION_ENV, ProcessContext
from shmtrain.fabric.shm.control import PeerFailure, PeerTimeout
from shmtrain.fabric.shm.segment import open_descriptor
from shmtrain.fabric.trust import UntrustedError, read_private, write_private
from shmtrain.runtime.launch.job_dir import JobDir
from shmtrain.runtime.launch.replacement import LAUNCHER_ENV, STATE_FILE_ENV
from shmtrain.runtime.outputs import metrics_tail
from shmtrain.startup import mark

#: the key of a kept state that holds the interrupted step's row
PENDING = "pending_row"
#: the key of a kept state that says how its strategy recovers (``Strategy.recovery``)
MODE = "recovery"
#: the key of a kept state of an asynchronous strategy that holds W_g
GLOBAL = "global_weights_seen"
#: the key of a kept state that holds its block of replicas (first rank, size)
REPLICAS = "replicas"
#: the key of a donor's state that says whether its replacement is its replica
DONOR = "donor"
#: the failures a survivor waits out instead of exiting (a peer that stalls is not
#: replaced: it is alive; the launcher ends the job as before)
PEER_LOSS = (PeerFailure,)


def enabled(strategy: Any) -> bool:
    """Whether this worker recovers in place: its launcher replaces (it said so in the
    environment) and the strategy recovers so (``Strategy.recovery``)."""
    return bool(os.environ.get(LAUNCHER_ENV)) and getattr(strategy, "recovery", "restart") in ("replica", "elastic")


def elastic(strategy: Any) -> bool:
    """Whether ``strategy`` recovers in place as an asynchronous one: its survivors are
    not held by a death, so they look for one after each iteration."""
    return enabled(strategy) and strategy.recovery == "elastic"


def folder() -> Path | None:
    """The launch's private folder (where the strategies' step journals are)."""
    job = JobDir.from_env()
    return None if job is None else job.path


def prepare(strategy: Any) -> None:
    """Before training: a strategy whose survivors need more than their own state keeps it
    from now on (``Strategy.prepare_recovery``: gpi's step journal), in the launch's
    private folder."""
    where = folder()
    if enabled(strategy) and where is not None:
        strategy.prepare_recovery(where)


def keep(trainer: Any) -> dict[str, Any] | None:
    """A copy of this rank's state as it stands between steps (the model, optimizer,
    strategy, loop, schedule and loss-scale state: what a checkpoint holds), taken
    without draining exchanges (a peer is gone: they would not complete), as the strategy
    completes it (``Strategy.recovery_state``); None where it cannot (every worker
    restarts from the latest checkpoint instead)."""
    strategy = trainer.engine.strategy
    state = strategy.recovery_state(trainer.state_dict(copy=True, quiesce=False))
    if state is None:
        return None
    state[MODE] = strategy.recovery
    group = strategy.replicas()
    state[REPLICAS] = [group.start, len(group)]
    if strategy.recovery == "elastic":  # W_g as this survivor sees it: a replacement starts from it
        state[GLOBAL] = strategy.global_weights_copy()
    loss = trainer.pending_loss
    # the step the death interrupted: its row, should this rank go on after it (a donor completed it)
    state[PENDING] = {"iteration": int(state["train"]["iteration"]) + 1, "lr": trainer.lr,
                      "loss": float(loss.detach()) if loss is not None else None}
    return state


def replacement_state() -> dict[str, Any] | None:
    """In a replacement worker: the donor's state it starts from (None elsewhere)."""
    path = os.environ.get(STATE_FILE_ENV)
    return load_state(Path(path), float(os.environ.get("SHMTRAIN_TIMEOUT", "120"))) if path else None


def elastic_start(trainer: Any, donor: dict[str, Any], metrics: Path) -> tuple[dict[str, Any], int]:
    """A replacement of an asynchronous strategy: the state it loads (its own, fresh,
    with the iterations the dead worker had logged in ``metrics`` and, on the master,
    W_g as the donor saw it) and that count; after loading it takes W_g as its weights
    (``take_global_weights``), and its rows go on from there: none missing, none twice."""
    steps = logged(metrics)
    state = trainer.state_dict(copy=True)
    state["strategy"]["iteration"] = steps
    if "global_weights" in state["strategy"]:  # the master keeps W_g: the donor's view of it
        state["strategy"]["global_weights"] = donor[GLOBAL]
    state["train"]["iteration"] = steps
    state[PENDING], state[MODE] = None, "elastic"
    return state, steps


def recover(ctx: ProcessContext, kept: dict[str, Any], failure: BaseException) -> dict[str, Any]:
    """:func:`rejoin`, again as long as a worker dies while the job forms again (the
    replacement killed during its set-up is replaced in turn, while the budget lasts)."""
    while True:
        try:
            return rejoin(ctx, kept, failure)
        except DiedWhileForming as exc:
            failure = exc.failure


class DiedWhileForming(Exception):
    """A worker died while the job's next generation formed (``failure``: what this
    rank met); the launcher replaces it in turn, or says no."""

    def __init__(self, failure: BaseException) -> None:
        super().__init__(str(failure))
        self.failure = failure


def rejoin(ctx: ProcessContext, kept: dict[str, Any], failure: BaseException) -> dict[str, Any]:
    """After a peer's death: post this rank's steps, leave the job, wait for the
    launcher's plan, join the next generation (``ctx`` becomes its context); the state
    to continue from. ``failure`` is raised again when the launcher does not replace
    (no replacement left, or the death was not one a replacement cures)."""
    steps = int(kept["train"]["iteration"])
    mark("recover-kept")
    ctx.store.set(f"recover/{ctx.local_rank}", str(steps))
    plan = read_plan(ctx, failure)
    mark("recover-plan")
    ctx.close()  # this generation's process groups; its segments go with the session's objects
    reports = {int(rank): int(done) for rank, done in plan["reports"].items()}
    dead, (first, size) = int(plan["replaced"]), kept[REPLICAS]
    donor, replica = choose_donor(reports, dead, size)
    if donor == ctx.local_rank:
        _save({**{k: v for k, v in kept.items() if k != PENDING}, DONOR: {"replica": replica}}, Path(plan["state"]))
    if replica and first <= dead < first + size and steps < reports[donor]:
        state = _adopt(load_state(Path(plan["state"]), ctx.timeout), kept)  # a replica a step behind
    else:
        state = dict(kept, **{PENDING: None})  # this rank's own: nothing adopted, nothing to log
    own = open_descriptor(int(plan["pid"]), int(plan["fd"]), "the control block of the next generation")
    os.environ.update(SHMTRAIN_CONTROL=str(plan["control"]), SHMTRAIN_CONTROL_FD=str(own),
                      **{GENERATION_ENV: str(plan["generation"])})
    mark("recover-state")
    try:
        ctx.take_over(fabric_context.from_env(ctx.timeout))
    except PEER_LOSS as exc:  # a death while the job forms again: report in the new generation's keys
        if dist.is_initialized():
            dist.destroy_process_group()
        ctx.store = fabric_context.local_store(ctx.timeout)
        raise DiedWhileForming(exc) from exc
    mark("recover-joined")
    return state


def read_plan(ctx: ProcessContext, failure: BaseException) -> dict[str, Any]:
    """The launcher's plan for the next generation (raising ``failure`` when it gives
    up), read from the job's store (a FileStore in its private folder) and checked."""
    deadline = time.monotonic() + ctx.timeout
    while not ctx.store.check(["recover/plan"]):
        if time.monotonic() > deadline:
            raise failure
        time.sleep(0.01)
    plan = json.loads(ctx.store.get("recover/plan"))
    if plan.get("fail"):
        raise failure
    if str(plan.get("pid")) != os.environ.get(LAUNCHER_ENV):
        raise UntrustedError(f"the plan of the job's next generation names process {plan.get('pid')}, not this "
                             "run's launcher; refused (docs/security.md)")
    return plan


def choose_donor(reports: dict[int, int], dead: int, size: int) -> tuple[int, bool]:
    """Whose state the replacement of ``dead`` starts from, and whether that one is its
    replica (``size``: the ranks of a block of replicas, ``Strategy.replicas``): the
    survivor of the dead rank's block with the most completed steps (the lowest rank of
    those), else (an asynchronous worker alone in its block) the lowest surviving rank,
    which gives it W_g. Every survivor computes the same from the plan's reports."""
    first = dead // size * size
    block = [rank for rank in reports if first <= rank < first + size]
    if block:
        return max(block, key=lambda rank: (reports[rank], -rank)), True
    return min(reports), False


def with_global_weights(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with W_g in its strategy's state when a donor saw one and its own
    strategy state has none (a member's state taken by the master, which writes W_g)."""
    if GLOBAL in state and "global_weights" not in state["strategy"]:
        state["strategy"] = dict(state["strategy"], global_weights=state[GLOBAL])
    return state


def _adopt(donor: dict[str, Any], kept: dict[str, Any]) -> dict[str, Any]:
    """The donor's state with this rank's own RNG states, and this rank's row of the
    step the donor completed and this rank had computed up to its exchange (its loss is
    the one an unkilled run logs there)."""
    donor = with_global_weights(donor)
    donor["train"] = dict(donor["train"], rng=kept["train"]["rng"])
    pending = kept.get(PENDING)
    donor[PENDING] = pending if pending and pending["iteration"] == donor["train"]["iteration"] else None
    return donor


def logged(metrics: Path) -> int:
    """The last iteration of a rank's metrics file (0: none yet), read from its end."""
    return metrics_tail.last_iteration(metrics)


def catch_up_rows(state: dict[str, Any], metrics: Path, stamp: float) -> list[dict[str, Any]]:
    """The metrics rows this rank's file lacks up to the step every rank goes on from:
    the step this rank adopted, with the loss it had computed for it (``recovered``:
    its phases were not timed); in a replacement, the step the dead worker had sent its
    gradient for and died before logging, whose loss died with it (``loss`` null,
    ``lost``). Without them the file would skip an iteration."""
    last = logged(metrics)
    pending = state.get(PENDING) or {}
    rows = []
    for iteration in range(last + 1, int(state["train"]["iteration"]) + 1):
        if pending.get("iteration") == iteration and pending.get("loss") is not None:
            rows.append({"iteration": iteration, "loss": pending["loss"], "lr": pending["lr"], "t0": stamp,
                         "time": {}, "recovered": True})
        else:
            rows.append({"iteration": iteration, "loss": None, "lr": None, "t0": stamp, "time": {},
                         "lost": "the worker that computed it was killed and replaced"})
    return rows


def _save(state: dict[str, Any], path: Path) -> None:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_private(path, buffer.getvalue())


def load_state(path: Path, timeout: float) -> dict[str, Any]:
    """The donor's state file, once it is there (a private file of this run, loaded with
    ``weights_only``: tensors and plain values only)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise PeerTimeout(f"the donor's state {path.name} did not appear within {timeout:.0f} s")
        time.sleep(0.01)
    data = read_private(path, "the donor's state")
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)

