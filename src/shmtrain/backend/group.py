"""The ``shm`` backend object: c10d's ``Backend``, registered for the CPU.

``torch.distributed`` wraps it in its own ``ProcessGroup`` (as it does gloo and
out-of-tree backends), so group names, ``destroy_process_group``, per-device dispatch,
``monitored_barrier``, subgroups and DDP work as they do on gloo.

``allreduce`` of one CPU float or integer tensor (float32, float64, bfloat16, float16, and
gloo's integers; contiguous or not; one that requires grad is reduced on its
``.detach()``\\ ed data, as gloo does) with SUM or AVG (of integers as NCCL's,
:mod:`~shmtrain.backend.reduce_ops`) goes through the host's shared memory
(:class:`~shmtrain.backend.reducer.HostReducer`);
so does each such tensor of ``allreduce_coalesced``. Inside a host the other collectives go
through shared memory too (:mod:`~shmtrain.backend.collectives`), and so does a sparse
tensor's SUM (:mod:`~shmtrain.backend.sparse`). The rest is gloo's, on a gloo backend built
over the same store: those collectives across hosts, other ops and dtypes (one tensor at a
time in ``allreduce_coalesced``, whose list gloo's ``allreduce`` would take for copies of
one buffer), ``allreduce_sparse``, monitored_barrier and send/recv.
"""

from __future__ import annotations

import atexit
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend, Work

from shmtrain.backend import front, sparse
from shmtrain.backend.collectives import Collectives
from shmtrain.backend.reduce_ops import DTYPES, reduction
from shmtrain.backend.reducer import HostReducer
from shmtrain.backend.work import ShmBackendError

NAME = "shm"
_live: set[ShmBackend] = set()  # groups not yet shut down (c10d holds them through C++ only)


def _ours(tensor: torch.Tensor) -> bool:
    """A tensor the shared-memory path reduces."""
    return tensor.device.type == "cpu" and tensor.layout == torch.strided and tensor.dtype in DTYPES


class ShmBackend(Collectives, Backend):
    """The ``shm`` backend of one group (module docstring).

    Args:
        store: the group's store (c10d hands each group its own prefix).
        rank: this rank in the group; size: the group's ranks.
        timeout: how long any wait for a peer lasts (the group's timeout).
        group_name: the group's name (errors name it).
        global_ranks: the group's ranks in the default group (errors name them); empty for
            the default group itself.
    """

    #: tensors this process has reduced through shared memory (all groups; for tests and
    #: for users who want to see that their allreduce did not fall back to gloo)
    reductions = 0
    #: allreduce calls (and tensors of allreduce_coalesced) handed to gloo
    fallbacks = 0
    #: groups of this backend created in this process
    groups = 0
    #: prefix of its profiler events (``shm:all_reduce``; gloo's read ``gloo:all_reduce``)
    profile_name = NAME

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta, *,
                 group_name: str = "", global_ranks: list[int] | None = None) -> None:
        super().__init__(rank, size)
        self._global = list(global_ranks or [])
        self.who = f"shm backend, {self._rank_name(rank)} of group {group_name!r}"
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        self.reducer = HostReducer(store, rank, size, timeout, self.who, self._rank_name)
        self._closed = False
        _live.add(self)
        ShmBackend.groups += 1

    @classmethod
    def create(cls, options: Any, backend_options: Any = None) -> Backend:
        """c10d's creator (``register_backend(..., extended_api=True)``): the group's
        backend behind its C++ front where it can have one (:mod:`~shmtrain.backend.front`;
        the front's ``inner`` is the :class:`ShmBackend`, and its attributes read through)."""
        backend = cls(options.store, options.group_rank, options.group_size, options.timeout,
                      group_name=str(options.group_id), global_ranks=list(options.global_ranks_in_group))
        return front.wrap(backend)

    @staticmethod
    def count_fast(op: str) -> None:
        """A call the C++ front finished: counted as the Python path counts it."""
        Collectives.through_shm[op] += 1
        if op == "all_reduce":
            ShmBackend.reductions += 1

    def _finish_fast(self, op: str, rc: int, sent: torch.Tensor | None, out: torch.Tensor | None, mean: bool,
                     extra: int) -> Work:
        """The rest of a call the C++ front began (:meth:`HostReducer.finish_fast
        <shmtrain.backend.reducer.HostReducer.finish_fast>`)."""
        ShmBackend.count_fast(op)
        return self.reducer.finish_fast(op, rc, sent, out, mean, extra)

    def _rank_name(self, rank: int) -> str:
        if self._global and self._global[rank] != rank:
            return f"rank {rank} (global rank {self._global[rank]})"
        return f"rank {rank}"

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return NAME

    @property
    def inline(self) -> bool:
        """Whether reductions run on the caller's thread (else on the group's thread)."""
        return self.reducer.inline

    @staticmethod
    def _count() -> None:
        ShmBackend.reductions += 1

    # -- the shared-memory allreduce -----------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        opts = opts if opts is not None else dist.AllreduceOptions()
        mean = _mean(opts.reduceOp)
        if mean is None and len(tensors) == 1 and self._other_reduction(tensors, reduction(opts.reduceOp)):
            return self._reduce_in_host(tensors, reduction(opts.reduceOp), _profile("all_reduce", tensors))
        if mean is False and len(tensors) == 1 and tensors[0].layout == torch.sparse_coo:
            self.reducer.check()
            work = sparse.all_reduce(self, tensors[0])  # a sparse SUM inside the host, as gloo's
            if work is not None:
                Collectives.through_shm["all_reduce"] += 1
                return work
        if mean is None or len(tensors) != 1 or not _ours(tensors[0]):
            # other ops and tensors; a list of several is gloo's too (it reduces the list as
            # copies of one buffer, the old multi-device semantics)
            self.reducer.check()
            ShmBackend.fallbacks += 1
            Collectives.through_gloo["all_reduce"] += 1
            return self.gloo.allreduce(tensors, opts)
        Collectives.through_shm["all_reduce"] += 1
        return self.reducer.submit(tensors, mean, self._count, _profile("all_reduce", tensors))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        """Each tensor reduced on its own: SUM/AVG of float tensors in shared memory (one
        submission, one profiler event, as gloo's); other ops and dtypes by gloo's
        ``allreduce_coalesced`` (never its ``allreduce`` of the list, which reduces the list
        as copies of one buffer: MAX of ``[1, 4]`` and ``[2, 3]`` gave ``[4, 4]``); a list
        that mixes both (torch's API allows one dtype per call, so only through this
        backend's own API) in shared memory and by gloo one tensor at a time."""
        self.reducer.check()
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        mean = _mean(opts.reduceOp)
        if mean is None and self._other_reduction(tensors, reduction(opts.reduceOp)):
            return self._reduce_in_host(list(tensors), reduction(opts.reduceOp), _profile("all_reduce", tensors),
                                        "all_reduce_coalesced")
        ours = [t for t in tensors if mean is not None and _ours(t)]
        if tensors and len(ours) == len(tensors):
            Collectives.through_shm["all_reduce_coalesced"] += 1
            return self.reducer.submit(ours, bool(mean), self._count, _profile("all_reduce", ours))
        if not ours:
            ShmBackend.fallbacks += 1
            Collectives.through_gloo["all_reduce_coalesced"] += 1
            return self._gloo("allreduce_coalesced", tensors, opts)
        gloo = []
        for tensor in tensors:
            if not any(tensor is t for t in ours):
                options = dist.AllreduceOptions()
                options.reduceOp, options.timeout = opts.reduceOp, opts.timeout
                ShmBackend.fallbacks += 1
                gloo.append(self.gloo.allreduce([tensor], options))
        return self.reducer.submit(ours, bool(mean), self._count, _profile("all_reduce", ours), gloo, list(tensors))

    # -- everything else: gloo ---------------------------------------------------------
    def _gloo(self, name: str, *args: Any) -> Work:
        self.reducer.check()
        if self.gloo is None:
            raise ShmBackendError(f"{self.who}: the group was destroyed; create a new one")
        return getattr(self.gloo, name)(*args)

    # (each of torch's Backend methods, handed to gloo; the group's failure is said first)
    def monitored_barrier(self, opts: Any = None, wait_all_ranks: bool = False) -> None:
        self.reducer.check()
        timeout = getattr(opts, "timeout", None)
        if timeout is None or timeout < timedelta(0):
            self.gloo.monitored_barrier(wait_all_ranks=wait_all_ranks)
        else:
            self.gloo.monitored_barrier(timeout, wait_all_ranks)

    def allreduce_sparse(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        return self._gloo("allreduce_sparse", tensors, opts or dist.AllreduceOptions())

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Work:
        return self._gloo("send", tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Work:
        return self._gloo("recv", tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Work:
        return self._gloo("recv_anysource", tensors, tag)

    def _set_sequence_number_for_group(self) -> None:
        self.gloo._set_sequence_number_for_group()

    def _get_sequence_number_for_group(self) -> int:
        return self.gloo._get_sequence_number_for_group()

    def set_timeout(self, timeout: timedelta) -> None:
        """The group's new timeout (``dist.distributed_c10d.set_timeout``): gloo's and the
        shared-memory waits'."""
        if self.gloo is not None:
            self.gloo.set_timeout(timeout)
        self.reducer.timeout = self.reducer.host.timeout = timeout.total_seconds()

    def shutdown(self) -> None:
        """Stop the reduction thread and release the shared memory
        (``destroy_process_group``; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        try:
            self.reducer.close()
        finally:  # gloo's threads are joined even where the shared-memory half failed to stop
            # dropped, not only shut down: its destructor joins its threads now, before the
            # interpreter's finalization (a gloo thread that frees a work's tensors later needs
            # the GIL then, and aborts the process: "terminate called without an active exception")
            gloo, self.gloo = self.gloo, None
            gloo.shutdown()
            del gloo

    def abort(self) -> None:
        """``dist.abort``-like teardown: the peers' waits end with this rank's failure."""
        if not self._closed:
            self.reducer.control.abort(self.reducer.host.local_rank, 1)
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter shutdown: best effort
            pass


def _profile(op: str, tensors: list[torch.Tensor]) -> Any:
    """A profiler record of the call (its tensors' shapes), while a profiler records."""
    if not torch.autograd._profiler_enabled():
        return None
    return torch._C._autograd._record_function_with_args_enter(f"{ShmBackend.profile_name}:{op}", *tensors)


@atexit.register
def _shutdown_all() -> None:
    """Groups never destroyed are shut down before the interpreter finalizes (their gloo
    threads would otherwise free tensors then, which needs the GIL, and abort)."""
    for backend in list(_live):
        try:
            backend.shutdown()
        except Exception:  # noqa: BLE001 - exiting: best effort
            pass


def _mean(op: Any) -> bool | None:
    """True for AVG, False for SUM, None for any other op. ``op == SUM``, not ``op in (SUM,
    AVG)``: the options hold a ReduceOp, which equals a RedOpType only when it is on the left."""
    if op == dist.ReduceOp.SUM:
        return False
    if op == dist.ReduceOp.AVG:
        return True
    return None


#: the name the backend had when it was a Python ProcessGroup (scripts count its reductions)
ShmProcessGroup = ShmBackend
