"""The ``shm`` backend's allreduce through the host's shared memory, and its failures.

:class:`HostReducer` runs :class:`~shmtrain.fabric.allreduce.pipeline.PipelinedAllreduce`
inside a host (each private byte through DRAM once in and once out); across hosts it is
hierarchical (the host sum, then gloo among the hosts' local rank 0s, then the result back
inside each host). It reduces on the caller's thread where the host has no core to spare,
else on one thread per group (FIFO: every rank reduces in the order it issued the calls).

Every call first exchanges a header (numel, dtype, op) through the call ring
(:mod:`~shmtrain.backend.calls`: one hand-off; every rank reads every header), so ranks
that pass different tensors all raise, naming the mismatch, before any byte is reduced; a
tensor of at most :data:`~shmtrain.backend.calls.CALL_BYTES` travels with its header and
is summed from there (one hand-off in all; in C for float32), larger ones go through the
pipeline. A failure (a peer died, did not
call within the group's timeout, a mismatch, an error of the reduction itself) fails the
call's :class:`~shmtrain.backend.work.ShmWork` with a :class:`ShmBackendError` naming
this rank, the peer and the cause; it is recorded in the host's control block (the other
local ranks' waits end at once, with this rank's reason, which it writes in its line of
the header segment), and every later call of the group raises that the group failed.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shmtrain.backend.calls import REASON_BYTES, CallRing
from shmtrain.backend.host_layout import inline, layout
from shmtrain.backend.host_ops import HostOps
from shmtrain.backend.reduce_ops import DTYPES, FLOATS, KIND_CODE, KINDS, MOVED, MOVED_CODE, ROOTED, average
from shmtrain.backend.work import ShmBackendError, ShmWork
from shmtrain.fabric.allreduce.pipeline import PipelinedAllreduce
from shmtrain.fabric.job import hosts
from shmtrain.fabric.job.hierarchy import Hierarchy
from shmtrain.fabric.shm.control import DIED, PeerFailure, PeerTimeout, first_line

#: abort codes beside :data:`~shmtrain.fabric.shm.control.DIED`: the rank named did not answer
#: within the timeout (recorded by the peer that gave up on it), or failed on its own
TIMED_OUT, FAILED = 254, 1
_WHAT_TO_DO = "Destroy it (dist.destroy_process_group) and create a new one"
_STOP_S = 10.0  # a stopping reduction thread's waits end within 50 ms of the abort


class _Mismatch(Exception):
    """The ranks' headers differ (the message lists them). ``across_hosts``: seen by the
    hosts' leaders only (their hosts' other ranks must be told)."""

    def __init__(self, text: str, across_hosts: bool = False) -> None:
        super().__init__(text)
        self.across_hosts = across_hosts


#: the header a host's leader sends the other hosts when its own ranks disagree
_DISAGREE = (-1, -1, -1, -1)


class HostReducer:
    """Sum or average float CPU tensors of one group in place through shared memory.

    Args:
        store: the group's store; rank, size: this rank and the group's size.
        timeout: how long any wait for a peer lasts (the group's timeout).
        who: how errors name this rank and group (``"shm backend, rank 1 of group '0'"``).
        rank_name: how errors name a rank of the group (with its global rank).
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta, who: str,
                 rank_name: Callable[[int], str]) -> None:
        node, local_rank, local_world = layout(store, rank, size, "shm")
        self.timeout = timeout.total_seconds()
        self.host = hosts.form_host(store, str(node), local_rank, local_world, hosts.run_id(store, rank),
                                    self.timeout, name="pg")
        self.control = self.host.control
        self.who, self._rank_name = who, rank_name
        self.node, self.local_world, self.size = node, local_world, size
        self.hosts = size // local_world
        self.leaders = None
        if self.hosts > 1 and local_rank == 0:
            self.leaders = hosts.leaders_from_store(store, node, self.hosts, timeout)
        self.hierarchy = Hierarchy(self.host, self.leaders, across=self.hosts > 1)
        self.inline = inline(local_world)
        # on a thread its waits sleep at once: spinning would take the core from the backward
        # pass running beside it (measured either way, the difference was noise)
        self.spin = None if self.inline else False
        self.pipeline = PipelinedAllreduce(self.host, spin=self.spin, tag="pg")
        self.calls_ring = CallRing(self.host, self.spin, self.pipeline._lib)  # every call's header
        self._reasons = self.calls_ring.reasons
        self.ops = HostOps(self.host, self.spin, self.calls_ring)  # every other collective's ring
        self.host.barrier("the shm backend's set-up")
        #: the C++ front's gate (:mod:`~shmtrain.backend.front`), where it fronts this group
        self.gate: Any = None
        self.failure: ShmBackendError | None = None
        self._cause = ""
        self._phase = ""
        self._op = "all_reduce"  # the op of the call under way (errors name it)
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0  # calls queued for the thread and not yet done
        self.queued = 0  # calls handed to the thread so far
        self._pending_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="shmtrain-pg", daemon=True)
        if not self.inline:
            self._thread.start()

    # -- calls -------------------------------------------------------------------------
    def submit(self, tensors: list[torch.Tensor], mean: bool, counted: Callable[[], None], profile: Any = None,
               gloo: Sequence[Any] = (), result: list[torch.Tensor] | None = None) -> ShmWork:
        """Reduce ``tensors`` (one after the other): now on this thread, or queued for the
        group's thread; returns the call's :class:`ShmWork` of ``result`` (default
        ``tensors``; also waiting for ``gloo``'s works of the same call), done where the
        call ran on this thread. ``counted`` is
        called per tensor reduced. ``profile``: the call's profiler record
        (``_record_function_with_args_enter``), ended when the reduction is; a profiled call
        runs on the group's thread even where reductions are inline, so that its event is
        asynchronous like gloo's (upstream's profiling tests check it). Calls queued before
        it keep their order."""
        small = sum(t.numel() * t.element_size() for t in tensors) <= self.carried
        return self.submit_call(lambda: self._reduce_each(tensors, mean, counted),
                                tensors if result is None else result, profile, gloo, small)

    def submit_call(self, run: Callable[[], None], tensors: list[torch.Tensor], profile: Any = None,
                    gloo: Sequence[Any] = (), small: bool = False) -> ShmWork:
        """Run ``run`` (a call's shared-memory part, which begins with :meth:`begin`) and
        return its Work of ``tensors``, as :meth:`submit` does: in the order of the calls,
        of any op. A ``small`` call (its data travels with its header: one hand-off, a few
        microseconds once the peers are there) runs on this thread even where the group has
        a reduction thread, when nothing is queued for it: handing it to the thread and
        back would cost more than the call (``shmtrain bench floors``)."""
        if (self.inline or small) and profile is None and not self._pending:
            error, interrupted = self._call(run)
            if interrupted is not None:
                raise interrupted
            return ShmWork(tensors, gloo, pending=False, error=error)
        work = ShmWork(tensors, gloo)
        self.queued += 1
        if not self._thread.is_alive():
            self._thread.start()
        with self._pending_lock:
            self._pending += 1
            self._arm()
        self._queue.put((run, work, profile))
        return work

    def begin(self, op: str, numel: int, dtype: torch.dtype, kind: str, extra: int = 1, *,
              own: tuple[int, ...] = (), payload: torch.Tensor | None = None, total: torch.Tensor | None = None,
              mean: bool = False) -> int:
        """Start call ``n`` (returned) of ``op``: the header hand-off of ``(numel, dtype,
        kind, extra)`` (``kind`` one of :data:`~shmtrain.backend.reduce_ops.KINDS`, ``extra``
        the root or the tensors in the call), which every local rank must pass alike, with
        this rank's ``own`` words and its data for the call ring (``payload``, or what the
        caller put there with :meth:`CallRing.copy_in
        <shmtrain.backend.calls.CallRing.copy_in>`; inside one host only); ``total``:
        summed there from every rank's payload (:meth:`CallRing.exchange
        <shmtrain.backend.calls.CallRing.exchange>`)."""
        n = self.calls + 1
        self._op = op
        self._phase = f"call {op} #{n}"
        self._exchange_headers(n, (numel, MOVED_CODE[dtype], KIND_CODE[kind], extra), own, payload, total, mean)
        self._phase = f"finish a block of {op} #{n}"
        return n

    @property
    def calls(self) -> int:
        """Calls so far (every rank counts alike: the header's number)."""
        return self.calls_ring.seq

    def attach(self, gate: Any) -> None:
        """Front this group with the C++ front's ``gate``: armed while a call may take its
        fast path (nothing queued for the thread, the group not failed or closed)."""
        self.gate = gate
        self._arm()

    def _arm(self) -> None:
        if self.gate is not None:
            self.gate.arm(self.hosts == 1 and not self._pending and self.failure is None and not self._closed)

    def finish_fast(self, op: str, rc: int, sent: torch.Tensor | None, out: torch.Tensor | None, mean: bool,
                    extra: int) -> ShmWork:
        """The rest of a call of ``op`` the C++ front began and could not finish at once
        (``rc``: :meth:`CallRing.resume <shmtrain.backend.calls.CallRing.resume>`): a small
        allreduce of ``sent`` (``out`` the same), a barrier (neither), a broadcast of
        ``sent`` from root ``extra``, an ``all_gather_into_tensor`` of ``sent`` into
        ``out``. The front holds the gate, released here."""
        ring = self.calls_ring

        def run() -> None:
            n = self.calls
            self._op, self._phase = op, f"call {op} #{n}"
            if not ring.resume(rc, sent if op == "all_reduce" else None, mean, f"{op} #{n}"):
                raise _Mismatch(self._mismatch(n, ring.headers(),
                                               lambda r: self._rank_name(self.node * self.local_world + r)))
            if op == "broadcast" and extra != self.host.local_rank:
                ring.copy_out(out, extra)
            elif op == "all_gather_into_tensor":
                self.ops.collected(out, sent)  # as the Python path's own small all_gather

        error, interrupted = self._call(run, held=True)
        if interrupted is not None:
            raise interrupted
        return ShmWork([out] if out is not None else [], (), pending=False, error=error)

    @property
    def carried(self) -> int:
        """The bytes of a rank's data that travel with a call's header (0 across hosts)."""
        return self.calls_ring.payload_bytes if self.hosts == 1 else 0

    def check(self) -> None:
        """Raise if the group failed earlier (every later call of the group says so)."""
        if self.failure is not None:
            raise ShmBackendError(f"{self.who}: the group failed earlier and cannot continue "
                                  f"({self._cause}). {_WHAT_TO_DO}")

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._reduce_all(*item)
            finally:
                with self._pending_lock:
                    self._pending -= 1
                    self._arm()

    def _reduce_each(self, tensors: list[torch.Tensor], mean: bool, counted: Callable[[], None]) -> None:
        for tensor in tensors:
            self._reduce(tensor, mean, len(tensors))
            counted()

    def _reduce_all(self, run: Callable[[], None], work: ShmWork, profile: Any = None) -> None:
        """A queued call, on the group's thread (its call ring's waits sleep at once)."""
        error, interrupted = self._call(run, profile, self.spin)
        work.finish(error)
        if interrupted is not None:
            raise interrupted

    def _call(self, run: Callable[[], None], profile: Any = None, spin: bool | None = None,
              held: bool = False) -> tuple[BaseException | None, BaseException | None]:
        """Run one call: its error (the group fails with it), and a Ctrl-C to re-raise once
        the call's Work is finished. ``spin``: how its call ring's waits wait (None: the
        host's rule, for a call on the caller's thread, which has nothing else to do).
        ``held``: the C++ front's gate is this call's already (it began there)."""
        error: BaseException | None = None
        interrupted: BaseException | None = None
        gate = self.gate
        with self._lock:  # one call at a time: callers on several threads share the rings
            if gate is not None and not held:
                gate.enter()  # and with the front's fast calls
            self.calls_ring.spin = spin
            try:
                self.check()
                run()
            except ShmBackendError as exc:  # the group had failed before
                error = exc
            except Exception as exc:  # this call failed: so does the group from here on
                error = self._fail(exc)
            except BaseException as exc:  # Ctrl-C inline: the peers must not wait out the timeout
                error = self._fail(RuntimeError(f"interrupted ({type(exc).__name__})"))
                interrupted = exc
            finally:
                if gate is not None:
                    gate.leave()
        if profile is not None:  # ended before the work is: a profiler stopped after wait() has it
            torch._C._autograd._record_function_with_args_exit(profile)
        return error, interrupted

    def _reduce(self, tensor: torch.Tensor, mean: bool, count: int) -> None:
        """One tensor (of ``count`` in its call): the header hand-off with the tensor's data
        where it fits (summed from there), else followed by the pipeline (on a contiguous
        copy of a strided tensor, copied back; on the data of a tensor that requires grad)."""
        data = tensor.detach()
        buffer = data if data.is_contiguous() else data.contiguous()
        blockwise = mean and buffer.is_floating_point()  # integers: NCCL's average of the sum
        kind = "AVG" if mean else "SUM"
        if buffer.numel() * buffer.element_size() <= self.carried:  # one hand-off: the header's
            self.begin("all_reduce", data.numel(), data.dtype, kind, count, payload=buffer, total=buffer,
                       mean=blockwise)
        else:
            n = self.begin("all_reduce", data.numel(), data.dtype, kind, count)
            if self.hosts == 1:  # a float mean is taken block by block while each is in cache
                self.pipeline(buffer, op="mean" if blockwise else "sum")
            else:  # the host's sum, the leaders' sum, back inside the host
                self.hierarchy.reduce_private(buffer, self._host_sum, back=lambda: self._taking(n))
        if mean and (self.hosts > 1 or not blockwise):
            average(buffer, self.size)
        if buffer is not data:
            data.copy_(buffer)

    def _host_sum(self, buffer: torch.Tensor) -> None:
        """The pipeline's sum inside the host (:meth:`Hierarchy.reduce_private`'s host part)."""
        self.pipeline(buffer, op="sum")

    def _taking(self, n: int) -> None:
        """The way back of call ``n``: a failed wait names it."""
        self._phase = f"take all_reduce #{n}'s result from its host's leader"

    def _exchange_headers(self, n: int, mine: tuple[int, int, int, int], own: tuple[int, ...] = (),
                          payload: torch.Tensor | None = None, total: torch.Tensor | None = None,
                          mean: bool = False) -> None:
        """Publish ``(numel, dtype, kind, tensors in the call or root)`` for call ``n`` (with
        the call's data, :meth:`begin`), wait for every local rank's and compare; across
        hosts the leaders compare their hosts' through gloo."""
        L = self.local_world
        local: _Mismatch | None = None
        if not self.calls_ring.exchange(mine, f"{self._op} #{n}", own, payload, total, mean):
            local = _Mismatch(self._mismatch(n, self.calls_ring.headers(),
                                             lambda r: self._rank_name(self.node * L + r)))
        if self.hierarchy.group is not None:  # the hosts' leaders compare theirs through gloo; a leader
            # whose host disagrees sends _DISAGREE, so the other hosts raise too (not time out)
            sent = _DISAGREE if local is not None else mine
            gathered = self.hierarchy.all_gather(torch.tensor(sent, dtype=torch.int64))
            rows = [tuple(int(v) for v in g) for g in gathered]
            if local is None and any(row != rows[self.node] for row in rows):
                # the leader alone saw it: its host's other ranks are told through the abort
                raise _Mismatch(self._mismatch(n, rows, lambda h: f"the host of {self._rank_name(h * L)}"),
                                across_hosts=True)
        if local is not None:
            raise local

    def _mismatch(self, n: int, rows: list[tuple[int, ...]], name: Callable[[int], str]) -> str:
        def one(numel: int, dtype: int, op: int, count: int) -> str:
            if (numel, dtype, op, count) == _DISAGREE:
                return "its own ranks passed different tensors"
            kind = str(MOVED[dtype]).replace("torch.", "") if 0 <= dtype < len(MOVED) else f"dtype #{dtype}"
            what = KINDS[op] if 0 <= op < len(KINDS) else f"op #{op}"
            if what in ROOTED:
                call = f" to or from rank {count}"
            else:
                call = f" in a call of {count} tensors" if count > 1 else ""
            return f"{numel} x {kind} {what}" + call

        said = ", ".join(f"{name(r)}: {one(*row)}" for r, row in enumerate(rows))
        return (f"{self.who}: {self._op} #{n}: the ranks passed different tensors ({said}); "
                "every rank must pass the same numel, dtype and op, in the same calls and order")

    # -- failures ------------------------------------------------------------------------
    def _fail(self, exc: Exception) -> ShmBackendError:
        """The error that names the cause of ``exc``; the group fails with it, and the other
        local ranks' waits end (the control block's abort, with this rank's reason)."""
        me, n = self.host.local_rank, self.calls
        aborted = self.control.aborted()
        blame: tuple[int, int] | None = None  # (local rank, code) to record in the control block
        if isinstance(exc, _Mismatch):
            text = str(exc)  # every rank saw the headers (or its leader's abort): each raises its own
            blame = (me, FAILED) if exc.across_hosts else None
        elif isinstance(exc, PeerTimeout) and exc.peer is not None:
            peer = exc.peer
            text = (f"{self.who}: {self._op} #{n} failed: {self._local(peer)} did not {self._phase} within "
                    f"{self.timeout:g} s (the group's timeout; Timed out waiting for it): it is alive but did not call "
                    "the collective, or is stuck")
            blame = (peer, TIMED_OUT)
        elif isinstance(exc, PeerFailure) and aborted is not None:
            who, code = aborted
            if code == DIED:
                cause = (f"{self._local(who)} died (it exited or was killed) while this rank waited for it "
                         f"to {self._phase}")
            elif who == me:
                cause = f"a peer gave up on this rank ({self._reasons_of_peers() or 'no reason recorded'})"
            elif code == TIMED_OUT:
                cause = f"{self._local(who)} did not answer within the group's timeout ({self._reasons_of_peers()})"
            else:
                cause = f"{self._local(who)} failed ({self._reasons_of_peers() or 'no reason recorded'})"
            text = f"{self.who}: {self._op} #{n} failed: {cause}"
        else:
            text = f"{self.who}: {self._op} #{n} failed on this rank: {type(exc).__name__}: {first_line(exc, 400)}"
            blame = (me, FAILED)
        error = ShmBackendError(f"{text}. The group cannot continue: {_WHAT_TO_DO[0].lower()}{_WHAT_TO_DO[1:]}")
        self._write_reason(text)  # before the abort: a peer woken by it reads the reason
        if blame is not None:
            self.control.abort(*blame)
        self._cause = text.split(": ", 1)[-1]
        self.failure = error
        self._arm()
        return error

    def _local(self, local_rank: int) -> str:
        return f"{self._rank_name(self.node * self.local_world + local_rank)} (pid {self.control.pid(local_rank)})"

    def _write_reason(self, text: str) -> None:
        raw = text.split(": ", 1)[-1].encode()[: REASON_BYTES - 1]
        line = self._reasons[self.host.local_rank]
        line[:] = 0
        line[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)

    def _reasons_of_peers(self) -> str:
        texts = []
        for r in self.host.ranks:
            raw = bytes(self._reasons[r]).split(b"\0", 1)[0]
            if r != self.host.local_rank and raw:
                texts.append(
                    f"{self._rank_name(self.node * self.local_world + r)} said: {raw.decode(errors='replace')}"
                )
        return "; ".join(texts)

    def close(self) -> None:
        """Stop the thread (a reduction still waiting for a peer is failed first: the
        control block's abort wakes it) and release the shared memory. A second call does
        nothing."""
        if self._closed:
            return
        self._closed = True
        self._arm()
        if self._thread.is_alive():
            with self._pending_lock:  # queued or running: counted from submit() to the end
                unfinished = self._pending
            if unfinished:
                self.control.abort(self.host.local_rank, FAILED)
            self._queue.put(None)
            self._thread.join(timeout=_STOP_S)
            if self._thread.is_alive():  # it would take the GIL during finalization: an abort
                raise ShmBackendError(
                    f"{self.who}: the reduction thread did not stop within {_STOP_S:g} s "
                    "of the group's shutdown (blocked outside the host's waits)"
                )
        if self.leaders is not None:  # joined now, not at the interpreter's finalization
            leaders, self.leaders, self.hierarchy.group = self.leaders, None, None
            leaders.shutdown()
            del leaders
        self.pipeline.close()
        self.ops.close()
        self.calls_ring.close()
        self.control.segment.close()


__all__ = ["DTYPES", "FLOATS", "HostReducer", "ShmBackendError", "ShmWork"]
