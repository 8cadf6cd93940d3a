"""Layer-wise reduction and broadcast overlapped with backward, one-sided (CaffeGPI).

CaffeGPI Fig. 3 (turn-based communication on rank r) and Fig. 4 (distributed model
accumulation during the local backward): for every layer, as backward produces its
gradient, the worker

1. checks which partial gradients of its children in a binomial reduction tree have
   arrived (higher ranks send to lower ones: ``parent(r) = r - lowbit(r)``), adds them
   to its own and writes the sum into its parent's segment with a notification;
2. at the root (rank 0): averages the layer's gradient, updates *that layer* with the
   optimizer (the layer-wise update the paper adds to Caffe's solver) and notifies its
   children that the layer's new weights are in place; they flow down the same tree
   (lower ranks to higher);
3. for every layer whose new weights its parent has announced: copies them from the
   parent's segment into its own parameters (a one-sided read, GASPI's ``gaspi_read``)
   and notifies its own children.

Down the tree the data is read by the child rather than written by the parent (the
paper writes): both are one-sided, but the root is the busiest rank of the tree (it
reduces, updates and feeds every subtree) while its children wait for it at the
finalization, so moving the copies to the children shortens the critical path. On
ResNet-18 with 2 workers the root spent 9 ms per iteration writing weights into its
child's parameters while the child slept 17 ms in the finalization (cProfile).

Sends are triggered, never awaited (a write into a peer's shared memory plus a
notification, :mod:`shmtrain.fabric.exchanges.onesided`); a notification carries the exchange's
number, ``steps + 1`` (the exchanges of this process: the notification words start at 0
with the window, also after a resumed run restored ``iteration``). A finalization phase
(``collect_remaining``) ties the loose ends: it sleeps on this rank's doorbell until
every layer's new weights are in place. There is no global barrier between iterations:
a rank that holds the complete new model starts the next forward at once.

Where progress happens: Python runs backward on one thread, so the turns of Fig. 3 run
inside the gradient hooks (one turn per parameter) and, after backward, in the
finalization loop. A helper thread sleeping on the doorbell would react sooner, but with
one compute thread per core it only takes time slices from backward, and it would race
the optimizer and autograd over the same tensors; the turn-based design is the paper's.

Why reading a parent's weights is safe: a parent overwrites a layer's weights only at
the next iteration's update (or read) of that layer, which needs this rank's gradient of
that layer in the next iteration, i.e. after this rank holds every layer of this
iteration. Gradient slots are reused one iteration later only after the receiver
consumed them, for the same reason: nobody starts iteration k+1 before holding every
layer of iteration k.

The optimizer runs on the root only, on the user's optimizer object (its
``param_groups`` are narrowed to the layers being updated for the call, so state, hyper-
parameters and schedulers stay the user's). A large layer is updated alone as soon as its
gradient is complete; small layers (a BatchNorm's 64 weights) are updated together once
``UPDATE_BATCH`` elements are ready, or at the finalization: one optimizer call costs
~25 us of Python whatever its size, and ResNet-18's 62 calls per iteration on the root's
critical path cost 3% of an iteration (measured with cProfile, 1 worker). Optimizers
whose step couples parameters (L-BFGS) are not supported.

Staged (GPU parameters, :class:`shmtrain.strategies.layout.staging.HostStaging`): the window keeps
each rank's weights and gradient slots in host memory, the model stays on the GPU. A
gradient hook only starts the copy of its gradient into a pinned host buffer on the
device-to-host stream and hands the layer to a host thread
(:class:`shmtrain.strategies.layout.courier.Courier`), so backward's kernels keep coming: the
turns run there, on a GPU the compute is the device's and a host thread takes nothing
from it. The courier waits for the copy (a CUDA event), marks the layer's own gradient
ready and takes a turn. The root copies a layer's mean into ``param.grad`` on the
host-to-device stream, steps it on the GPU and copies the new weights into its area
before announcing them (once that copy has landed); a child copies its parent's weights
into its own area (for its children) and into its GPU parameters. After backward the
training thread waits for the courier (``d2h_wait``), takes the finalization's turns
itself, waits for copies still in flight, then the next forward's stream waits for the
copies to the GPU.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from shmtrain.fabric.exchanges.weights import broadcast_parameters
from shmtrain.strategies.base import Strategy, StrategyConfig, register
from shmtrain.strategies.layout.flat import FlatLayout
from shmtrain.strategies.optim.step_journal import JournaledSteps

#: the root updates ready layers once they hold this many elements (or at finalization)
UPDATE_BATCH = 1 << 18


@register
class GPI(JournaledSteps, Strategy):
    """Synchronous SGD with layer-wise one-sided tree reduction and broadcast."""

    name = "gpi"
    synchronous = True
    #: a worker killed on one host is replaced in place: every rank goes on from the state
    #: after the last whole step, which the root journals (``strategies/optim/step_journal.py``)
    recovery = "replica"
    shared_gradients = False  # each rank's own (the root's holds the mean, the others partial sums)
    fp16_reason = ("the root updates layer by layer during backward, while a GradScaler unscales "
                   "and steps the whole optimizer once per iteration")
    grad_clip_reason = ("the root updates each layer as its reduced gradient arrives during backward, "
                        "before the whole gradient's norm is known")

    @dataclass(kw_only=True, slots=True)
    class Config(StrategyConfig):
        """``gpi`` has no options: the tree and the layer order follow from the job."""

    def __init__(self, config, ctx, model, optimizer, timer=None, *, transports=None) -> None:
        # the parameters live in host shared memory (the peers write into them): CPU only,
        # refused otherwise by the base (``devices``)
        super().__init__(config, ctx, model, optimizer, timer, transports=transports)
        self.world = ctx.local_world
        self.me = me = ctx.local_rank
        self.layout = layout = FlatLayout(self.params)
        numel, dtype = layout.numel, layout.dtype
        self.layer_bytes = numel * torch.empty((), dtype=dtype).element_size()
        self.num_layers = n = len(self.params)
        # Area of rank r: its parameters, then one gradient slot per child (fabric/exchanges/tree_window.py)
        hosts = ctx.num_nodes > 1
        self.tree = tree = self.transports.tree_window(self.layer_bytes, n, across_hosts=hosts, tag="gpi")
        self.window = tree.window
        self.parent, self.children, self.fanin = tree.parent, tree.children, tree.fanin
        area = tree.weights(me, dtype, numel)
        self.staging = self.make_staging(layout) if self.staged else None
        if self.staging is None:  # the parameters are views of this rank's area
            self._weights = layout.bind_data(area)
        if hosts:  # every host's tree starts from global rank 0's weights
            broadcast_parameters(layout)
        if self.staging is not None:  # the area holds a host copy of the GPU weights
            area.copy_(layout.gather())
            self._weights = layout.views(area)
            self.staging.register(area)
        self.transports.barrier("gpi set-up")
        if me != 0:  # one broadcast of the initial weights, from the root's area
            area.copy_(tree.weights(0, dtype, numel))
        self.transports.barrier("gpi initial weights")
        if self.staging is not None and me != 0:
            layout.scatter(area)
        if self.parent >= 0:
            self._parent_weights = layout.views(tree.weights(self.parent, dtype, numel))
        self._slots = [
            layout.views(tree.slot(me, j, dtype, numel))
            for j in range(len(self.children))
        ]
        if self.parent >= 0:
            self._parent_slot_id = tree.parent_slot
            self._parent_slot = layout.views(tree.slot(self.parent, tree.parent_slot, dtype, numel))
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._groups = [
            next(g for g in optimizer.param_groups if any(q is p for q in g["params"])) for p in self.params
        ]
        self._own = np.zeros(n, dtype=bool)  # this rank's gradient is ready
        self._sent = np.zeros(n, dtype=bool)  # reduced and sent up (root: updated)
        self._have = np.zeros(n, dtype=bool)  # new weights in place and sent down
        self._ready: list[int] = []  # root: averaged, awaiting the optimizer
        self._ready_numel = 0
        # staged: gradients copied to host buffers, and the copies still in flight
        self._host_grads = self.staging.pinned if self.staging is not None else None
        self._outgoing: list[tuple[list[int], object]] = []  # root: (layers, Copy) of new weights
        self._stepped = 0  # root: layers updated in this step
        self._copy_s = 0.0
        #: staged: the host thread that waits for the gradients' copies and takes the turns
        self.courier = self.staging.courier("shmtrain-gpi") if self.staging is not None else None
        # Across hosts each host's root (its leader) sums its tree's gradient of a layer
        # with the other hosts' leaders on a thread (HostCombiner), then averages and
        # updates that layer itself: every leader applies the same update.
        self.total = ctx.world_size
        self._summed = np.zeros(n, dtype=bool)  # leader: the job's sum is in place
        self._combiner = self.transports.host_combiner(
            range(n - 1, -1, -1), lambda layer, k: self._grad(layer),
            lambda layer, k: self.window.notify_self(self._combined_id(layer), k), name="gpi-hosts")

    @property
    def busy(self) -> int:
        """>0 while a hook runs, and always on the courier's thread (the root's layer-wise
        optimizer steps there are the strategy's own, not the user's). Only the hooks set
        it, and on their thread it is theirs alone."""
        courier = getattr(self, "courier", None)
        return self._hook_busy or int(courier is not None and threading.get_ident() == courier.ident)

    @busy.setter
    def busy(self, value: int) -> None:
        self._hook_busy = value

    # -- notification ids (per receiver) -------------------------------------------
    def _grad_id(self, layer: int, child_slot: int) -> int:
        return self.tree.grad_id(layer, child_slot)

    def _weights_id(self, layer: int) -> int:
        return self.tree.weights_id(layer)

    def _combined_id(self, layer: int) -> int:
        return self.tree.combined_id(layer)

    def _grad(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s gradient in host memory (staged: its pinned copy)."""
        if self._host_grads is not None:
            return self._host_grads[layer]
        return self.params[layer].grad

    # -- one turn of Fig. 3 ------------------------------------------------------------
    def on_gradient_ready(self, param: torch.Tensor) -> None:
        layer = self._index[id(param)]
        if self.staging is not None:  # stream-ordered work only; the turn on the courier
            copy = self.staging.to_host(layer, param.grad, dst=self._host_grads[layer])[1]
            self.courier.submit(self._gradient_landed, layer, copy)
            return
        self._own[layer] = True
        self._turn()

    def _gradient_landed(self, layer: int, copy) -> None:
        """Courier: the layer's own gradient is ready once its copy has landed; a turn."""
        self._copy_s += copy.wait()
        self._own[layer] = True
        self._turn()

    def _landed(self, wait: bool = False) -> bool:
        """Staged, the root: announce the new weights whose copies to its area have landed
        (``wait``: block for the oldest one); return True if any had."""
        moved = False
        seq = self.steps + 1
        while self._outgoing and (wait or self._outgoing[0][1].done()):
            layers, copy = self._outgoing.pop(0)
            copy.wait()
            for layer in layers:
                self._send_down(layer, seq)
            moved, wait = True, False
        return moved

    def _turn(self) -> bool:
        """Act on what has arrived; return True if anything moved."""
        seq = self.steps + 1
        moved = self._landed() if self.staging is not None else False
        words = self.window.notifications()
        pending = self._own & ~self._sent
        if pending.any():
            if self.children:
                grads = words[: self.num_layers * self.fanin].reshape(self.num_layers, self.fanin)
                pending &= (grads[:, : len(self.children)] >= seq).all(axis=1)
            for layer in np.flatnonzero(pending):
                self._reduce(int(layer), seq)
                moved = True
        if self._combiner is not None:
            summed = (words[self._combined_id(0):] >= seq) & self._sent & ~self._summed
            for layer in np.flatnonzero(summed):
                self._summed[layer] = True
                self._grad(layer).mul_(1.0 / self.total)
                self._queue_update(int(layer), seq)
                moved = True
        if self.parent >= 0:
            arrived = (words[self._weights_id(0) : self._combined_id(0)] >= seq) & ~self._have
            for layer in np.flatnonzero(arrived):
                self._weights[layer].copy_(self._parent_weights[layer])  # the one-sided read
                if self.staging is not None:  # and on into the GPU's parameters
                    self.staging.to_device(int(layer), self.params[layer], self._weights[layer], data=True)
                self._send_down(int(layer), seq)
                moved = True
        return moved

    def _reduce(self, layer: int, seq: int) -> None:
        grad = self._grad(layer)
        self._sent[layer] = True
        if self.parent >= 0:
            for slot in self._slots:
                grad.add_(slot[layer])
            self.window.write_notify(
                self.parent, self._parent_slot[layer], grad,
                self._grad_id(layer, self._parent_slot_id), seq,
            )
            return
        if self._combiner is not None:  # this host's sum, then the other hosts'
            for slot in self._slots:
                grad.add_(slot[layer])
            self._combiner.submit(layer, seq)
            return
        if self.world == 2:  # (a + b) / 2, rounded as DDP's mean is (a lerp is not)
            grad.add_(self._slots[0][layer]).mul_(0.5)
        elif self.world > 2:
            for slot in self._slots:
                grad.add_(slot[layer])
            grad.mul_(1.0 / self.world)
        self._queue_update(layer, seq)

    def _queue_update(self, layer: int, seq: int) -> None:
        """Root: the layer's mean gradient is in ``grad``; update it with the next batch."""
        p = self.params[layer]
        self._ready.append(layer)
        self._ready_numel += p.numel()
        if self._ready_numel >= UPDATE_BATCH:
            self._update_ready(seq)

    def _update_ready(self, seq: int) -> None:
        """Root: one optimizer call for the averaged layers, then their weights go down."""
        if not self._ready:
            return
        staging = self.staging
        if staging is None:
            self._step_layers(self._ready)
            self._stepped += len(self._ready)
            if self._stepped == self.num_layers:
                self.journal_step()  # recovery in place: before the step's last layer goes down
            for layer in self._ready:
                self._send_down(layer, seq)
        else:  # mean to the GPU, step there, new weights back to the area, then announce
            for layer in self._ready:
                staging.to_device(layer, self.params[layer], self._host_grads[layer])
            staging.join()
            self._step_layers(self._ready)
            copy = None
            for layer in self._ready:
                copy = staging.to_host(layer, self.params[layer].data, dst=self._weights[layer])[1]
            self._outgoing.append((self._ready, copy))
        self._ready, self._ready_numel = [], 0

    def _send_down(self, layer: int, seq: int) -> None:
        """This rank holds the layer's new weights: tell the children to read them."""
        for child in self.children:
            self.window.notify(child, self._weights_id(layer), seq)
        self._have[layer] = True

    def _step_layers(self, layers: list[int]) -> None:
        """The optimizer's step for some parameters only (CaffeGPI's layer-wise update)."""
        optimizer = self.optimizer
        groups = optimizer.param_groups
        narrowed: dict[int, dict] = {}
        for layer in layers:
            group = self._groups[layer]
            narrowed.setdefault(id(group), dict(group, params=[]))["params"].append(self.params[layer])
        optimizer.param_groups = list(narrowed.values())
        try:
            optimizer.step()
        finally:
            optimizer.param_groups = groups

    # -- finalization --------------------------------------------------------------------
    def after_backward(self) -> None:
        start = time.perf_counter()
        if self.courier is not None:  # the turns backward left to the courier; ours from here
            self.timer.add("d2h_wait", self.courier.drain(self.ctx.timeout))
        for layer in np.flatnonzero(~self._own):  # parameters backward did not reach
            if self.staging is not None:
                self._host_grads[layer].zero_()
            else:
                p = self.params[int(layer)]
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._own[layer] = True
        deadline = time.monotonic() + self.ctx.timeout
        while True:
            token = self.window.doorbell()
            if self._combiner is not None:
                self._combiner.check()
            self._turn()
            self._update_ready(self.steps + 1)
            if self._have.all():
                break
            if self.staging is not None and self._outgoing:
                waited = time.perf_counter()
                self._landed(wait=True)  # a copy in flight: wait for it, not for a peer
                self.timer.add("d2h_wait", time.perf_counter() - waited)
                continue
            senders, what = self._waiting_for()
            self.window.sleep(token, senders=senders, deadline=deadline, what=what)
        if self.staging is not None:
            self.staging.join()  # the next forward's stream waits for the weights
            self.timer.add("copy_to_host", self._copy_s)
            self.timer.add_copies("copy_to_device", self.staging.take_copies())  # timed when the iteration closes
            self._copy_s = 0.0
        elapsed = time.perf_counter() - start
        self.timer.add("collect_remaining", elapsed)
        self.timer.add("comm", elapsed)

    def _waiting_for(self) -> tuple[list[int], str]:
        """Who this rank waits for, and for what (for errors that name the peer)."""
        seq = self.steps + 1
        at = f"iteration {self.iteration + 1}"  # the run's number (seq restarts after a resume)
        unsent = np.flatnonzero(~self._sent)
        if unsent.size:
            layer = int(unsent[0])
            words = self.window.notifications()
            missing = [
                c for j, c in enumerate(self.children)
                if words[self._grad_id(layer, j)] < seq
            ]
            return missing or self.children, f"the gradient of layer {layer} ({at})"
        layer = int(np.flatnonzero(~self._have)[0])
        if self.parent < 0:  # a leader across hosts: its combiner waits for the others
            return [], f"the other hosts' sum of layer {layer} ({at})"
        return [self.parent], f"the new weights of layer {layer} ({at})"

    def apply_update(self) -> None:
        """Nothing left to do: the root updated each layer as its gradient was complete."""

    def after_update(self) -> None:
        self._stepped = 0
        self._own[:] = False
        self._sent[:] = False
        self._have[:] = False
        self._summed[:] = False
        super().after_update()

    # -- recovery in place ----------------------------------------------------------------
    def journals(self) -> bool:
        """The root journals each step (one host, CPU parameters: across hosts or staged, a
        death restarts every worker)."""
        return self.me == 0 and self.ctx.num_nodes == 1 and self.staging is None

    def finish(self) -> None:
        self.close_journal()
        if self._combiner is not None:
            self._combiner.close()
        if self.courier is not None:
            self.courier.close()
        if self.staging is not None:
            self.staging.close()
        super().finish()
