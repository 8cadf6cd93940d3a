"""One group of a host's workers, shaped like :class:`~shmtrain.fabric.shm.host.HostGroup`.

HSGD (ShmCaffe Section III-D, Fig. 4) runs the host's shared-memory allreduce inside
groups of S consecutive local ranks; :class:`HostSubgroup` gives a group the interface of
a host (local rank, local world, control block, segments) so that allreduce runs
unchanged. Built by :meth:`shmtrain.fabric.transports.Transports.subgroup`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from shmtrain.fabric.shm.host import HostGroup
from shmtrain.fabric.shm.segment import SharedSegment


class _GroupControl:
    """The host's control block seen by one group: group ranks -> local ranks."""

    def __init__(self, control, members: Sequence[int]) -> None:
        self._control = control
        self._members = list(members)

    def post(self, channel: int, rank: int, value: int) -> None:
        self._control.post(channel, self._members[rank], value)

    def get(self, channel: int, rank: int) -> int:
        return self._control.get(channel, self._members[rank])

    def wait(self, channel: int, ranks, target: int, *, timeout: float, what: str) -> None:
        self._control.wait(channel, [self._members[r] for r in ranks], target, timeout=timeout, what=what)

    def check_peers(self, me: int, what: str) -> None:
        """Raise if a peer of the host died or the host aborted (``me``: a group rank)."""
        self._control.check_peers(self._members[me], what)


class HostSubgroup:
    """One group of a host's workers, shaped like :class:`HostGroup` so the host's
    shared-memory allreduce runs inside the group unchanged.

    ``allocate`` stays a collective of the whole host: every rank allocates one segment
    per group, in the same order, and keeps its own group's.
    """

    def __init__(self, host: HostGroup, groups: int, group_size: int) -> None:
        self.host = host
        self.groups = groups
        self.group = host.local_rank // group_size
        self.members = [self.group * group_size + i for i in range(group_size)]
        self.local_rank = host.local_rank - self.members[0]
        self.local_world = group_size
        self.timeout = host.timeout
        self.control = _GroupControl(host.control, self.members)

    @property
    def ranks(self) -> range:
        return range(self.local_world)

    def channel(self, name: str) -> int:
        return self.host.channel(name)

    def allocate(
        self, tag: str, nbytes: int, init: Callable[[SharedSegment], None] | None = None
    ) -> SharedSegment:
        mine = None
        for group in range(self.groups):
            segment = self.host.allocate(f"{tag}.g{group}", nbytes, init)
            if group == self.group:
                mine = segment
        return mine
