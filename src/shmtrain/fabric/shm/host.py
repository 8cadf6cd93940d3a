"""The workers of one host: collective allocation of shared segments, channels, barriers.

Set-up is a collective among the host's local ranks, in the same order on each: local
rank 0 creates a segment and unlinks its name at once, before it is even sized (see
:mod:`shmtrain.fabric.shm.segment`), announces its name, process id and descriptor
through the torch.distributed store, and the others open that descriptor
(``/proc/<pid>/fd/<fd>``), map it and acknowledge. No name waits in /dev/shm for the
peers, so a SIGKILL of any local rank at any point of set-up leaves nothing behind. Every
rank knows the name (the run's prefix, the segment's index and tag): a different name in
the store is refused, and the segment is attached only if this user alone can open it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch.distributed as dist

from shmtrain.fabric.shm.control import ControlBlock, PeerFailure, PeerTimeout
from shmtrain.fabric.shm.segment import SharedSegment, open_descriptor
from shmtrain.fabric.trust import UntrustedError


class HostGroup:
    """The ``local_world`` workers of one host and their control block.

    Args:
        store: a torch.distributed store private to this host (a PrefixStore).
        local_rank: this worker's rank on the host.
        local_world: number of workers on the host.
        prefix: segment-name prefix of this run and host (``shmtrain-<run>-h<node>``).
        control: the host's control block (already attached).
        timeout: seconds any blocking call waits for a peer.
    """

    def __init__(
        self,
        store: dist.Store,
        local_rank: int,
        local_world: int,
        prefix: str,
        control: ControlBlock | None,
        timeout: float,
    ) -> None:
        self.store = store
        self.local_rank = local_rank
        self.local_world = local_world
        self.prefix = prefix
        self.control = control
        self.timeout = timeout
        self._segments = 0
        self._channels: dict[str, int] = {}
        self._barrier_channel = self.channel("host.barrier")
        if self.control is None:
            self.control = ControlBlock(
                self.allocate("control", ControlBlock.nbytes(local_world), _init_control(local_world)),
                local_world,
                init=False,
            )
        self._barrier_count = 0
        self.keep: list[SharedSegment] = []

    @property
    def allocated(self) -> int:
        """Segments allocated so far (every local rank counts the same)."""
        return self._segments

    @property
    def ranks(self) -> range:
        return range(self.local_world)

    def channels_used(self) -> int:
        """How many channels of the control block this host's users have asked for."""
        return len(self._channels)

    def channel(self, name: str) -> int:
        """A channel id for ``name``; every local rank must ask in the same order.

        A name asked for again (a second training, or a second allreduce of the same tag,
        on the same context) gets its channel back with every word at zero, since its new
        user counts from 1 and a word left at the old user's count would pass every wait:
        the ranks meet (all are past the old user), local rank 0 zeroes the words, and
        they meet again before anyone posts."""
        if name not in self._channels:
            self._channels[name] = len(self._channels)
            return self._channels[name]
        channel = self._channels[name]
        self.barrier(f"the reuse of channel {name!r}")
        if self.local_rank == 0:
            self.control.reset_channel(channel)
        self.barrier(f"the reuse of channel {name!r}")
        return channel

    def allocate(
        self, tag: str, nbytes: int, init: Callable[[SharedSegment], None] | None = None
    ) -> SharedSegment:
        """Collectively create one shared segment of ``nbytes`` mapped by every local rank.

        ``init`` runs on the creator before any peer can see the segment.
        """
        index = self._segments
        self._segments += 1
        name = f"{self.prefix}-{index}-{tag}"[:200]
        key = f"segment/{index}"
        if self.local_rank == 0:
            segment = SharedSegment(name, nbytes, create=True, named=False)  # no name left behind
            if init is not None:
                init(segment)
            if self.local_world == 1:
                return segment
            self.store.set(key, f"{name} {os.getpid()} {segment.fd}")
            self._await_count(f"{key}/attached", self.local_world - 1, f"attach of {name}")
        else:
            self._await_key(key, f"local rank 0's segment {name!r}")
            announced = self.store.get(key).decode(errors="replace")
            words = announced.split(" ")
            if len(words) != 3 or words[0] != name or not (words[1].isdigit() and words[2].isdigit()):
                # every rank knows the name: the store only says where it is open
                raise UntrustedError(
                    f"the job's store announced segment {announced[:80]!r} where this run's is {name!r}: "
                    "someone other than local rank 0 wrote the store; refused (run on a host and a store "
                    "that only this user reaches: docs/security.md)")
            pid, fd = int(words[1]), int(words[2])
            if self.control is not None and self.control.pid(0) > 0 and pid != self.control.pid(0):
                raise UntrustedError(
                    f"the job's store announced segment {name!r} open in process {pid}, which is not local "
                    f"rank 0 (pid {self.control.pid(0)}); refused (run on a host and a store that only this "
                    "user reaches: docs/security.md)")
            try:
                own = open_descriptor(pid, fd, f"shared-memory segment {name!r}")
            except OSError as exc:
                raise PeerFailure(f"local rank 0 (pid {pid}) ended before this worker attached segment "
                                  f"{name!r} ({exc.strerror})", peer=0) from None
            segment = SharedSegment(name, nbytes, create=False, fd=own)
            self.store.add(f"{key}/attached", 1)
        return segment

    def _await_key(self, key: str, what: str) -> None:
        """Sleep until ``key`` is in the store, raising :class:`PeerFailure` as soon as a
        peer of the host is found dead or failed (not at the store's timeout)."""
        deadline = time.monotonic() + self.timeout
        delay = 0.001
        while not self.store.check([key]):
            if self.control is not None:  # (the control block itself is being made)
                self.control.check_peers(self.local_rank, what)
            if time.monotonic() > deadline:
                raise PeerTimeout(f"{what}: not announced within {self.timeout:.0f} s", peer=0)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _await_count(self, key: str, count: int, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        delay = 0.001
        while self.store.add(key, 0) < count:
            if self.control is not None:
                self.control.check_peers(self.local_rank, what)
            if time.monotonic() > deadline:
                raise PeerTimeout(
                    f"{what}: only {self.store.add(key, 0)} of {count} peers answered within {self.timeout:.0f} s"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def barrier(self, what: str = "barrier") -> None:
        """Sleep until every local rank has reached this barrier (futex, no spinning)."""
        self._barrier_count += 1
        self.control.post(self._barrier_channel, self.local_rank, self._barrier_count)
        self.control.wait(self._barrier_channel, self.ranks, self._barrier_count, timeout=self.timeout, what=what)


def _init_control(local_world: int) -> Callable[[SharedSegment], None]:
    def init(segment: SharedSegment) -> None:
        ControlBlock(segment, local_world, init=True)

    return init
