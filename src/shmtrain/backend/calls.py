"""The ``shm`` backend's call hand-off: every call's header and, where the call is small,
all of its data, in one hand-off between the host's ranks.

Each call of the group, of any op, begins here: every local rank writes a header
(numel, dtype, kind, root or count: every rank must pass the same; then words of its own,
not compared, such as all_to_all's count of blocks) in its line of a small shared ring,
posts the call's number, waits until every local rank has posted it, and compares the
headers, so ranks that call different ops, sizes or roots all raise before any byte is
combined. A line also holds :data:`CALL_BYTES` of payload: a call whose every rank's data
fits there travels with its header (each rank writes its data beside its header, and reads
the others' after the hand-off), so a small collective costs one hand-off, not the
header's and then the data's. That is the latency term of small messages in Thakur,
Rabenseifner and Gropp, "Optimization of Collective Communication Operations in MPICH"
(2005): one step of alpha instead of two.

Ring reuse needs no other wait: position ``n % 2`` was last used by call ``n - 2``, which
every rank finished reading before it posted ``n - 1``, which this rank waited for.

Where the compiled library is there (:mod:`shmtrain.fabric.native`, ``call_native.c``), the
hand-off (and a float32 sum of the payloads) is one C call; it waits in slices and returns
here between them, so aborts, dead peers and the timeout are judged as on the Python path
(the same words, the same rules). Every local rank takes the same path (the pipeline's
choice, which the ranks agree on).
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import numpy as np
import torch

from shmtrain.fabric import native as _native
from shmtrain.fabric.allreduce.pipeline import all_read_sum
from shmtrain.fabric.shm.control import SPIN_S, YIELDS, PeerTimeout
from shmtrain.fabric.shm.host import HostGroup
from shmtrain.fabric.shm.segment import align
from shmtrain.fabric.shm.stitch import PAGE

RING = 2
HEADER_BYTES = 64  # 8 int64: 4 compared, 4 of the rank's own
COMPARED = 4
#: payload bytes of a rank's line: a call whose every rank's data fits goes in one hand-off
CALL_BYTES = 64 << 10
REASON_BYTES = 192  # a rank's failure text (read by the peers its abort wakes)
SLICE = 0.05  # seconds the compiled call waits before the caller checks peers and the timeout


class CallRing:
    """The call ring of one group's host (module docstring).

    Args:
        host: the host's workers of the group.
        spin: whether waits spin before sleeping (the reducer's rule; :attr:`spin` may change
            between calls: a call on the caller's thread waits by the host's rule, one on the
            reduction thread sleeps at once).
        lib: the compiled library (None: the Python path); every local rank alike.
        payload_bytes: bytes of data a rank's line carries.
        tag: name fragment of the segment and the channel.
    """

    def __init__(self, host: HostGroup, spin: bool | None, lib: Any, payload_bytes: int = CALL_BYTES,
                 tag: str = "pg-call") -> None:
        L = host.local_world
        self.host, self.spin, self.L, self.me = host, spin, L, host.local_rank
        self.payload_bytes = payload_bytes
        self.line = align(HEADER_BYTES + payload_bytes, 64)
        announce_at = align(L * REASON_BYTES, PAGE)
        ring_at = announce_at + 2 * PAGE  # the compiled path's announcements, then its completion word
        self.segment = host.allocate(tag, ring_at + RING * L * self.line)
        self._channel = host.channel(f"{tag}.posted")
        raw = np.frombuffer(self.segment.buffer, dtype=np.uint8, count=ring_at + RING * L * self.line)
        #: every local rank's failure text (``reason`` lines)
        self.reasons = raw[:L * REASON_BYTES].reshape(L, REASON_BYTES)
        lines = raw[ring_at:].reshape(RING, L, self.line)
        self._headers = lines[:, :, :HEADER_BYTES].view(np.int64)  # (RING, L, 8)
        ring = self.segment.tensor(torch.uint8, ring_at, RING * L * self.line).view(RING, L, self.line)
        self._payloads = ring[:, :, HEADER_BYTES:HEADER_BYTES + payload_bytes]  # (RING, L, payload_bytes)
        self._ring_address = self.segment.address(ring_at)
        self._rows: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._seq = 0  # calls so far (the Python path's; the compiled path's is its progress record's)
        self._lib = lib
        if lib is not None:
            self._plan = native_plan(host, spin, self.segment, ring_at, announce_at, self.line, self._channel)
            self._progress = _native.Progress()
            self._plan_ref, self._progress_ref = ctypes.byref(self._plan), ctypes.byref(self._progress)
            self._header = (ctypes.c_int64 * 8)()

    @property
    def seq(self) -> int:
        """Calls so far (every local rank counts alike). On the compiled path it lives in
        the progress record, which the C++ front (:mod:`~shmtrain.backend.front`) advances
        too."""
        return self._progress.seq if self._lib is not None else self._seq

    @seq.setter
    def seq(self, value: int) -> None:
        if self._lib is not None:
            self._progress.seq = value
        else:
            self._seq = value

    # -- a call ------------------------------------------------------------------------
    def copy_in(self, src: torch.Tensor, offset: int = 0) -> None:
        """``src``'s bytes (contiguous) into this rank's payload of the next call at byte
        ``offset`` (what it sends beyond one tensor: then :meth:`exchange` without one)."""
        nbytes = src.numel() * src.element_size()
        if nbytes:
            ctypes.memmove(self._address((self.seq + 1) % RING, self.me) + offset, src.data_ptr(), nbytes)

    def copy_out(self, dst: torch.Tensor, rank: int, offset: int = 0, at: int = 0, nbytes: int | None = None) -> None:
        """``dst`` (contiguous) from its byte ``at`` <- ``nbytes`` (default its size in
        bytes) of ``rank``'s payload of the last call, from byte ``offset``."""
        if nbytes is None:
            nbytes = dst.numel() * dst.element_size()
        if nbytes:
            ctypes.memmove(dst.data_ptr() + at, self._address(self.seq % RING, rank) + offset, nbytes)

    def _address(self, position: int, rank: int) -> int:
        return self._ring_address + (position * self.L + rank) * self.line + HEADER_BYTES

    def rows(self, dtype: torch.dtype) -> torch.Tensor:
        """Every rank's payload of the last call as ``(L, payload_bytes / itemsize)`` of
        ``dtype`` (cached views)."""
        key = (self.seq % RING, dtype)
        view = self._rows.get(key)
        if view is None:
            view = self._rows[key] = self._payloads[key[0]].view(dtype)
        return view

    def slots(self) -> torch.Tensor:
        """Every rank's payload of the last call, ``(L, payload_bytes)`` uint8."""
        return self._payloads[self.seq % RING]

    def headers(self) -> list[tuple[int, ...]]:
        """Every rank's compared header words of the last call (for the mismatch's message)."""
        return [tuple(int(v) for v in row[:COMPARED]) for row in self._headers[self.seq % RING]]

    def owns(self, word: int = 0) -> list[int]:
        """Every rank's own word ``word`` (0-3) of the last call."""
        return [int(v) for v in self._headers[self.seq % RING, :, COMPARED + word]]

    def exchange(self, header: tuple[int, int, int, int], what: str, own: tuple[int, ...] = (),
                 payload: torch.Tensor | None = None, total: torch.Tensor | None = None, mean: bool = False) -> bool:
        """Call ``seq + 1``: this rank's ``header`` and ``own`` words (and ``payload``'s bytes,
        contiguous, at most ``payload_bytes``, else what :meth:`copy_in` put in this rank's
        payload) to every
        local rank; wait for theirs. Returns whether every rank passed the same header;
        where they did and ``total`` (contiguous, the same tensor as ``payload``) is given,
        ``total`` <- the ranks' payloads summed as the pipeline's all-read path sums a
        block (:func:`~shmtrain.fabric.allreduce.pipeline.all_read_sum`; float32 in C, in
        rank order), divided by ``L`` where ``mean``. Raises the control block's
        :class:`PeerFailure` or :class:`PeerTimeout` (``what``: the call, as errors name it)."""
        if payload is not None and payload.numel() * payload.element_size() > self.payload_bytes:
            raise ValueError(f"a call's payload of {payload.numel() * payload.element_size()} bytes does not fit the "
                             f"call ring's {self.payload_bytes}; send its header alone and the data after it")
        if self._lib is not None:
            in_c = total is not None and total.dtype == torch.float32
            agree = self._compiled(header, what, own, payload, total if in_c else None, mean)
            if agree and total is not None and not in_c:
                self._sum(total, mean)
            return agree
        n = self.seq + 1
        k, me = n % RING, self.me
        words = self._headers[k, me]
        words[:COMPARED] = header
        words[COMPARED:] = 0
        words[COMPARED:COMPARED + len(own)] = own
        if payload is not None and payload.numel():
            flat = payload.reshape(-1)
            data = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
            self._payloads[k, me, :data.numel()].copy_(data)
        self.seq = n
        control = self.host.control
        if self.L > 1:
            control.post(self._channel, me, n)
            control.wait(self._channel, self.host.ranks, n, timeout=self.host.timeout, what=what, spin=self.spin)
            aborted = control.aborted()
            if aborted is not None and aborted[0] == me:  # a peer posted this call, then gave up on this rank
                control.check(me, what)
        rows = self._headers[k, :, :COMPARED]
        if not (rows == rows[me]).all():
            return False
        if total is not None:
            self._sum(total, mean)
        return True

    def _sum(self, total: torch.Tensor, mean: bool) -> None:
        if self.L > 1 and total.numel():
            all_read_sum(total.reshape(-1), self.rows(total.dtype)[:, :total.numel()], self.me, mean)

    def _compiled(self, header: tuple[int, int, int, int], what: str, own: tuple[int, ...],
                  payload: torch.Tensor | None, total: torch.Tensor | None, mean: bool) -> bool:
        words = self._header
        words[0], words[1], words[2], words[3] = header
        self._plan.mode = wait_mode(self.host.control, self.spin)
        for i in range(4):
            words[COMPARED + i] = own[i] if i < len(own) else 0
        progress = self._progress
        progress.pos, progress.phase = 0, 0
        nbytes = payload.numel() * payload.element_size() if payload is not None else 0
        args = (self._plan_ref, self._progress_ref, words, payload.data_ptr() if nbytes else None, nbytes,
                total.data_ptr() if total is not None else None, total.numel() if total is not None else 0,
                int(mean), SLICE)
        return self._finished(self._lib.shm_call(*args), args, what, total)

    def resume(self, rc: int, total: torch.Tensor | None, mean: bool, what: str) -> bool:
        """Finish the call the C++ front began on ``total`` (float32, contiguous: its payload
        and its sum; None: a header alone) and left with ``rc`` (1: its wait used its
        slice; -1: the abort; 2: the headers differ): wait on as :meth:`exchange` does.
        Returns whether the headers agreed."""
        n = total.numel() if total is not None else 0
        data = total.data_ptr() if n else None
        args = (self._plan_ref, self._progress_ref, self._header, data, n * 4, data, n, int(mean), SLICE)
        return self._finished(rc, args, what, total)

    def _finished(self, rc: int, args: tuple, what: str, total: torch.Tensor | None) -> bool:
        """A compiled call's end from its first return ``rc``: waited on where its slice ran
        out; ``total``'s version bumped where it was summed (written through a raw pointer)."""
        if rc == 1 or rc == -1:
            rc = self._wait_on(args, what)
        if total is not None and rc == 0:
            torch.autograd.graph.increment_version(total)
        return rc == 0

    def _wait_on(self, args: tuple, what: str) -> int:
        """A compiled call that has waited ``SLICE``: check the peer, then resume, until done."""
        progress, control, timeout = self._progress, self.host.control, self.host.timeout
        deadline = time.monotonic() + timeout
        while True:
            peer = progress.waiting
            control.check(peer, what)  # raises PeerFailure on an abort or a dead peer
            if time.monotonic() >= deadline:
                raise PeerTimeout(f"local rank {peer} (pid {control.pid(peer)}) did not reach {what} "
                                  f"#{progress.seq} within {timeout:.0f} s", peer=peer)
            rc = self._lib.shm_call(*args)
            if rc != 1 and rc != -1:
                return rc

    def geometry(self) -> tuple[int, int, int, int]:
        """The ring's address, a line's bytes, the local ranks and this one's (the C++
        front's copies out of the payloads)."""
        return self._ring_address, self.line, self.L, self.me

    def handles(self) -> tuple[int, int, int, int] | None:
        """The compiled path's addresses, for the C++ front: its plan, the plan's wait-mode
        word, its progress record and ``shm_call``; None on the Python path."""
        if self._lib is None:
            return None
        plan = ctypes.addressof(self._plan)
        return (plan, plan + type(self._plan).mode.offset, ctypes.addressof(self._progress),
                ctypes.cast(self._lib.shm_call, ctypes.c_void_p).value)

    def close(self) -> None:
        """Release the ring (no call may follow)."""
        self._payloads, self._rows = None, {}
        self.segment.close()


def native_plan(host: HostGroup, spin: bool | None, segment: Any, ring_at: int, announce_at: int, line: int,
          channel: int) -> _native.Plan:
    """The C side's view of the call ring and the host's control block (the pipeline's
    plan: ``ring`` the call ring, ``per`` a line's bytes / 4)."""
    control, L = host.control, host.local_world
    plan = _native.Plan()
    plan.ring = segment.address(ring_at)
    plan.announce = segment.address(announce_at)
    plan.done = segment.address(announce_at + PAGE)
    base, posted, sleepers = control.word_layout(channel)
    plan.ctrl = base
    plan.per = line // 4
    for r in range(L):
        plan.posted[r], plan.sleepers[r], plan.all[r] = posted[r], sleepers[r], r
    plan.L, plan.me = L, host.local_rank
    plan.mode = wait_mode(control, spin)
    plan.spin_ns, plan.yields = int(SPIN_S * 1e9), YIELDS
    return plan


def wait_mode(control: Any, spin: bool | None) -> int:
    """The compiled wait's mode, as ControlBlock.wait: spin when asked (None: the host's
    rule, cores >= ranks), yield when ranks outnumber cores, else sleep at once."""
    spin = control.spin if spin is None else spin
    return 0 if spin else (1 if not control.spin else 2)
