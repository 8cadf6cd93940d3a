"""One-sided write with notification between the workers of one host (GPI-ONESIDED).

CaffeGPI (Section 3.2) moves every chunk with GPI-2's ``gaspi_write_notify``: the
sender writes straight into a segment of the receiver and raises a notification; "the
receiver of the data chunk checks on the respective notification and acts on the
received data if necessary" without waiting for a specific chunk. On one host the
segments are POSIX shared memory, so a remote write is a copy into the peer's mapping.

Layout of the window (one shared segment, mapped by every local rank):

* one *doorbell* word per rank, each on its own cache line;
* one block of *notification* words per rank (the receiver), ``notifications`` long;
* one data *area* per rank, page aligned (sizes may differ between ranks).

Notification words are single-writer sequence words: for a given receiver, each id is
written by one sender only (as in GASPI, the caller assigns ids per sender), always with
a value that grows (an iteration number), so nobody ever resets them and a test is
``word >= value``. The doorbell exists so a receiver can sleep until *any* of its
notifications changes: a futex waits on one word, so every sender, after its
notification, stores a token unique to (sender, count) in the receiver's doorbell and
wakes it. The doorbell is only a wake-up hint (several senders may store into it); the
data and the notifications stay single-writer. A receiver reads the doorbell *before*
testing its notifications and sleeps only while the doorbell still holds that value, so a
notification raised in between is never slept through. Sleeps are cut in slices to check
the control block's abort word and the senders' liveness: a dead sender is named.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from shmtrain.fabric.shm.control import DIED, LINE, PeerFailure, PeerTimeout, alive
from shmtrain.fabric.shm.futex import futex_wait, futex_wake
from shmtrain.fabric.shm.host import HostGroup
from shmtrain.fabric.shm.segment import align
from shmtrain.fabric.shm.stitch import PAGE

_SLICE_S = 0.05  # how often a sleeping receiver re-checks abort and peer liveness


class OneSidedWindow:
    """Per-rank data areas and notification words that every local rank can write.

    Args:
        host: the host's workers (allocation is collective: same call on every rank).
        area_bytes: size of each rank's data area, one int for all or one per rank.
        notifications: notification ids per receiver.
        tag: name fragment of the segment.
    """

    def __init__(
        self,
        host: HostGroup,
        area_bytes: int | Sequence[int],
        notifications: int,
        *,
        tag: str = "onesided",
    ) -> None:
        world = host.local_world
        sizes = [int(area_bytes)] * world if isinstance(area_bytes, int) else [int(b) for b in area_bytes]
        if len(sizes) != world or any(b < 0 for b in sizes):
            raise ValueError(f"area_bytes must be one size or {world} non-negative sizes, got {area_bytes!r}")
        if notifications < 1:
            raise ValueError(f"a window needs at least one notification id, got {notifications}")
        self.host = host
        self.rank = host.local_rank
        self.world = world
        self.num_notifications = notifications
        self._stride = align(notifications * 4, LINE)  # words of one receiver, own lines
        words_at = LINE * world
        areas_at = align(words_at + self._stride * world, PAGE)
        self._area_offsets = []
        cursor = areas_at
        for size in sizes:
            self._area_offsets.append(cursor)
            cursor += align(max(size, 1), PAGE)
        self.area_bytes = sizes
        self.segment = host.allocate(tag, cursor)  # zero-filled by ftruncate
        buffer = self.segment.buffer
        self._doorbells = np.frombuffer(buffer, dtype=np.int32, count=world * LINE // 4)
        self._words = np.frombuffer(
            buffer, dtype=np.int32, count=world * self._stride // 4, offset=words_at
        ).reshape(world, self._stride // 4)[:, :notifications]
        self._doorbell_addr = [self.segment.address(r * LINE) for r in range(world)]
        self._rings = 0
        self._self_rings = 0

    # -- data -----------------------------------------------------------------------
    def area(self, rank: int, dtype: torch.dtype, offset: int = 0, numel: int | None = None) -> torch.Tensor:
        """A zero-copy view of ``rank``'s area (this rank's own or a peer's)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        if numel is None:
            numel = (self.area_bytes[rank] - offset) // itemsize
        if offset < 0 or offset + numel * itemsize > self.area_bytes[rank]:
            raise ValueError(
                f"view [{offset}, +{numel}x{itemsize}) outside the {self.area_bytes[rank]}-byte area "
                f"of local rank {rank}"
            )
        return self.segment.tensor(dtype, self._area_offsets[rank] + offset, numel)

    def write_notify(
        self, target: int, destination: torch.Tensor, data: torch.Tensor, notification: int, value: int
    ) -> None:
        """Copy ``data`` into ``destination`` (a view of ``target``'s area), then notify.

        The copy completes before the notification is stored, so a receiver that sees
        the notification sees the data: x86-64 makes stores visible in program order (the
        same assumption as the control block's sequence words).
        """
        destination.copy_(data.reshape(destination.shape))
        self.notify(target, notification, value)

    def notify(self, target: int, notification: int, value: int) -> None:
        """Raise ``notification`` of ``target`` to ``value`` and ring its doorbell."""
        self._words[target, notification] = value
        self._rings += 1
        # A token no other (sender, ring) pair produces: the doorbell never returns to a
        # value a sleeping receiver may have read, so a wake-up is never lost.
        token = self.rank + self.world * (self._rings % ((2**31 - 1) // self.world) + 1)
        self._doorbells[target * LINE // 4] = token
        futex_wake(self._doorbell_addr[target])

    def notify_self(self, notification: int, value: int) -> None:
        """Raise one of this rank's own notifications from another thread of this process
        (one that receives from another host) and ring this rank's doorbell.

        Its tokens are negative, so they never repeat one a local sender stored.
        """
        self._words[self.rank, notification] = value
        self._self_rings += 1
        self._doorbells[self.rank * LINE // 4] = -(self._self_rings % (2**31 - 1)) - 1
        futex_wake(self._doorbell_addr[self.rank])

    # -- receiving --------------------------------------------------------------------
    def notifications(self) -> np.ndarray:
        """This rank's notification words (a live view: read, never write)."""
        return self._words[self.rank]

    def test(self, notification: int, value: int) -> bool:
        """True when ``notification`` of this rank has reached ``value`` (never blocks)."""
        return int(self._words[self.rank, notification]) >= value

    def doorbell(self) -> int:
        """The current doorbell token; read it *before* testing notifications."""
        return int(self._doorbells[self.rank * LINE // 4])

    def sleep(self, token: int, *, senders: Sequence[int], deadline: float, what: str) -> None:
        """Sleep until the doorbell moves from ``token`` (at most one slice).

        Raises:
            PeerFailure: a rank of the host failed, or one of ``senders`` died (named).
            PeerTimeout: ``deadline`` (monotonic) passed; names the first of ``senders``.
        """
        try:
            self.check(senders, what)
        except PeerFailure:
            if self.doorbell() != token:
                return  # a notification came just before the sender ended: the caller tests it
            raise
        now = time.monotonic()
        if now >= deadline:
            if not senders:
                raise PeerTimeout(f"{what} did not arrive within {self.host.timeout:.0f} s")
            peer = senders[0]
            control = self.host.control
            raise PeerTimeout(
                f"local rank {peer} (pid {control.pid(peer) if peer >= 0 else '?'}) did not "
                f"send {what} within {self.host.timeout:.0f} s", peer=peer if peer >= 0 else None
            )
        futex_wait(self._doorbell_addr[self.rank], token, min(_SLICE_S, deadline - now))

    def check(self, senders: Sequence[int], what: str) -> None:
        """Raise :class:`PeerFailure` if the host aborted or a sender died."""
        control = self.host.control
        failed = control.aborted()
        if failed is not None:
            who, code = failed
            raise PeerFailure(
                f"local rank {who} (pid {control.pid(who)}) failed (code {code}) while this "
                f"worker waited for {what}", peer=who
            )
        for peer in senders:
            finished = control.finished_failure(peer, what, self.rank)
            if finished is not None:
                raise finished
            if not alive(control.pid(peer)):
                control.abort(peer, DIED)  # the root cause, before this worker's own failure
                raise PeerFailure(
                    f"local rank {peer} (pid {control.pid(peer)}) died while this worker "
                    f"waited for {what}", peer=peer
                )

    def wait(self, notification: int, value: int, *, sender: int, timeout: float, what: str) -> None:
        """Block until ``notification`` reaches ``value``; errors name ``sender``."""
        deadline = time.monotonic() + timeout
        while True:
            token = self.doorbell()
            if self.test(notification, value):
                return
            self.sleep(token, senders=[sender], deadline=deadline, what=what)
