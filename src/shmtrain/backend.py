"""A torch.distributed backend whose allreduce goes through the host's shared memory.

``import shmtrain`` registers it (issue 16, item 3), so an unchanged DDP script gets the
speed-up by naming it::

    dist.init_process_group("cpu:shm")        # or backend="shm"
    ddp = DistributedDataParallel(model)      # its buckets are averaged in shared memory

:class:`ShmProcessGroup` is a Python ``ProcessGroup`` (PyTorch accepts subclasses).
``allreduce`` of contiguous CPU tensors with SUM or AVG runs
:class:`~shmtrain.fabric.pipeline_allreduce.PipelinedAllreduce` inside a host (each
private byte through DRAM once in and once out, split reduction of swCaffe's PAR-SUM,
Section V-A, when ranks outnumber cores); across hosts it is hierarchical (the host
sum, then gloo among the hosts' local rank 0s, then the result back inside each host).
Like gloo's, it is asynchronous where the host has a core to spare: the call queues the
reduction on one thread per group (FIFO, so every rank runs them in the order it issued
them) and returns a ``Work`` at once, so DDP's backward keeps computing while earlier
buckets are reduced (the compiled path releases the GIL). Where every core already runs
a rank's torch threads, the reduction runs on the caller's thread and the ``Work`` is
complete when returned: a thread could only time-share the backward pass's core. Every other collective, and allreduce of anything
else, is gloo's, on a gloo group built over the same store.

Hosts: ranks are grouped host after host by ``LOCAL_WORLD_SIZE`` (torchrun sets it);
without it, by the host names every rank publishes in the store.
"""

from __future__ import annotations

import os
import queue
import secrets
import socket
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from shmtrain.fabric.affinity import allowed_cores
from shmtrain.fabric.host import HostGroup
from shmtrain.fabric.pipeline_allreduce import PipelinedAllreduce
from shmtrain.fabric.segment import PREFIX

NAME = "shm"
_FLOAT = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _layout(store: dist.Store, rank: int, size: int) -> tuple[int, int, int]:
    """``(node, local_rank, local_world)`` of this rank: torchrun's LOCAL_WORLD_SIZE when it
    divides the world, else from the host names in the store (ranks of a host contiguous)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if not (local_world and size % local_world == 0 and int(os.environ.get("WORLD_SIZE", size)) == size):
        store.set(f"host/{rank}", socket.gethostname())
        names = [store.get(f"host/{r}").decode() for r in range(size)]
        local_world = names.count(names[0])
        if any(names[r] != names[(r // local_world) * local_world] for r in range(size)) or size % local_world:
            raise ValueError(f"backend {NAME!r}: ranks must be laid out host after host with the same number "
                             f"on every host (host names by rank: {names}); set LOCAL_WORLD_SIZE or use gloo")
    node, local_rank = divmod(rank, local_world)
    return node, local_rank, local_world


def _inline(local_world: int) -> bool:
    """Whether allreduce runs on the caller's thread: when the host has no core to spare
    for a reduction thread beside every rank's torch threads (2 workers on 2 cores: the
    thread only time-shares the backward pass's core, and its hand-offs add wake-ups;
    measured in docs/collectives.md). ``SHMTRAIN_PG_THREAD=1`` or ``0`` decides instead."""
    forced = os.environ.get("SHMTRAIN_PG_THREAD", "")
    if forced in ("0", "1"):
        return forced == "0"
    return len(allowed_cores()) < local_world * (torch.get_num_threads() + 1)


class ShmProcessGroup(dist.ProcessGroup):
    """The ``shm`` backend's process group (module docstring).

    Args:
        store: the group's store (torch.distributed hands each group its own prefix).
        rank: this rank in the group; size: the group's ranks.
        timeout: how long any wait for a peer lasts.
    """

    #: tensors this process has reduced through shared memory (all groups; for tests and
    #: for users who want to see that their allreduce did not fall back to gloo)
    reductions = 0
    #: allreduce calls handed to gloo (other ops, other tensors)
    fallbacks = 0

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        node, local_rank, local_world = _layout(store, rank, size)
        if rank == 0:
            store.set("run_id", secrets.token_hex(4))
        run_id = store.get("run_id").decode()
        self.host = HostGroup(dist.PrefixStore(f"host{node}/", store), local_rank, local_world,
                              f"{PREFIX}-{run_id}-h{node}-pg", None, timeout.total_seconds())
        self.host.control.set_pid(local_rank, os.getpid())
        self.hosts = size // local_world
        self.leaders = None
        if self.hosts > 1 and local_rank == 0:
            self.leaders = dist.ProcessGroupGloo(dist.PrefixStore("leaders/", store), node, self.hosts, timeout)
        self.inline = _inline(local_world)
        # on a thread its waits sleep at once: spinning would take the core from the backward
        # pass running beside it (measured either way, the difference was noise)
        self.pipeline = PipelinedAllreduce(self.host, spin=None if self.inline else False, tag="pg")
        self.host.barrier("the shm backend's set-up")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._failure: BaseException | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="shmtrain-pg", daemon=True)
        if not self.inline:
            self._thread.start()

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NAME

    # -- the shared-memory allreduce -------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
        if opts is None:
            opts = dist.AllreduceOptions()
        # ``op == SUM``, not ``op in (SUM, AVG)``: the options hold a ReduceOp, which equals a
        # RedOpType only when it is on the left (``in`` compares the other way round)
        mean = op == dist.ReduceOp.AVG
        if not (mean or op == dist.ReduceOp.SUM) or not all(_ours(t) for t in tensors):
            ShmProcessGroup.fallbacks += 1
            return self.gloo.allreduce(tensors, opts)  # other ops and tensors: gloo's
        future: torch.futures.Future = torch.futures.Future()
        if self.inline:  # no spare core for a thread: reduce now, on the caller's thread
            self._reduce_all(tensors, mean, future)
        else:
            self._queue.put((tensors, mean, future))
        return _create_work_from_future(future)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        options = dist.AllreduceOptions()
        options.reduceOp = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
        return self.allreduce(tensors, options)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._reduce_all(*item)

    def _reduce_all(self, tensors: list[torch.Tensor], mean: bool, future: torch.futures.Future) -> None:
        with self._lock:  # one reduction at a time: callers on several threads share the ring
            try:
                if self._failure is not None:
                    raise self._failure
                for tensor in tensors:
                    self._reduce(tensor, mean)
                    ShmProcessGroup.reductions += 1
                future.set_result(tensors)
            except Exception as exc:  # the waiter re-raises it; the group is out of step from here on
                self._failure = self._failure or exc
                future.set_exception(exc)
            except BaseException as exc:  # Ctrl-C inline (a torch Future takes Exceptions only)
                self._failure = RuntimeError(f"an allreduce of this group was interrupted ({type(exc).__name__}); "
                                             "the group cannot be used any more")
                future.set_exception(self._failure)
                raise

    def _reduce(self, tensor: torch.Tensor, mean: bool) -> None:
        if self.hosts == 1:  # the mean is taken block by block while each is in cache
            self.pipeline(tensor, op="mean" if mean else "sum")
            return
        self.pipeline(tensor, op="sum")  # the host sums among the hosts' leaders, then back inside the host
        if self.leaders is not None:
            self.leaders.allreduce([tensor]).wait()
        self._host_broadcast(tensor)
        if mean:
            tensor.div_(self.size())

    def _host_broadcast(self, tensor: torch.Tensor) -> None:
        """Local rank 0's ``tensor`` into every local rank's (through the pipeline's ring:
        the others contribute zeros)."""
        if self.host.local_rank != 0:
            tensor.zero_()
        self.pipeline(tensor, op="sum")

    # -- everything else: gloo ---------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        return self.gloo.broadcast(tensors, opts or dist.BroadcastOptions())

    def barrier(self, opts=None):
        return self.gloo.barrier(opts or dist.BarrierOptions())

    def allgather(self, outputs, inputs, opts=None):
        return self.gloo.allgather(outputs, inputs, opts or dist.AllgatherOptions())

    def _allgather_base(self, output, input, opts=None):
        return self.gloo._allgather_base(output, input, opts or dist.AllgatherOptions())

    def gather(self, outputs, inputs, opts=None):
        return self.gloo.gather(outputs, inputs, opts or dist.GatherOptions())

    def scatter(self, outputs, inputs, opts=None):
        return self.gloo.scatter(outputs, inputs, opts or dist.ScatterOptions())

    def reduce(self, tensors, opts=None):
        return self.gloo.reduce(tensors, opts or dist.ReduceOptions())

    def reduce_scatter(self, outputs, inputs, opts=None):
        return self.gloo.reduce_scatter(outputs, inputs, opts or dist.ReduceScatterOptions())

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self.gloo.alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                       opts or dist.AllToAllOptions())

    def send(self, tensors, dst, tag=0):
        return self.gloo.send(tensors, dst, tag)

    def recv(self, tensors, src, tag=0):
        return self.gloo.recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag=0):
        return self.gloo.recv_anysource(tensors, tag)

    def shutdown(self) -> None:
        """Stop the reduction thread and release the shared memory (``destroy_process_group``;
        a second call does nothing)."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=10)
        self.pipeline.close()
        self.host.control.segment.close()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter shutdown: best effort
            pass


def _ours(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.dtype in _FLOAT


def create_group(store: dist.Store, rank: int, size: int, timeout: timedelta) -> ShmProcessGroup:
    """The ``shm`` backend's constructor, as torch.distributed calls it."""
    return ShmProcessGroup(store, rank, size, timeout)


def register(module: Any = None) -> None:
    """Register the ``shm`` backend with torch.distributed (idempotent; ``import shmtrain``
    already does, see ``shmtrain/__init__.py``). ``module``: torch.distributed itself,
    when it is handed over while being imported."""
    module = module if module is not None else dist
    if NAME not in module.Backend.backend_list:
        module.Backend.register_backend(NAME, create_group, devices=["cpu"])
