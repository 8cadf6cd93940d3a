"""Inside the host, across the hosts' leaders, back inside the host: the one composition.

Every host-aware exchange of shmtrain has the shape swCaffe gives its topology-aware
allreduce (You, Fang, Li et al., Section V-A: reduce over the fast links first, then
among one representative per node, then spread the result back over the fast links) and
ShmCaffe gives HSGD (Ahn et al., Section III-C: a group's workers share through shared
memory, the groups through the network). Inside a host the workers meet in shared memory;
across hosts only each host's local rank 0, its *leader*, talks to the other leaders over
the leaders' gloo group (formed by :mod:`shmtrain.fabric.job.hosts`); then the host's
other workers take the result from their leader.

:class:`Hierarchy` is that composition, written once. The exchanges (the shared-memory
allreduce, its bucketed form, the compressed mean, the per-layer combiner, the parameter
server's star and the ``shm`` backend) give it their host part and say which cross-host
operation their leader makes; no other module calls a collective on the leaders' group.
The result comes back inside the host one of two ways:

- **published** (:meth:`Hierarchy.finish`): the result lies in shared memory, so the
  leader posts a sequence word and the others sleep on it (the compressed mean's leader
  writes the decompressed mean to a board of its own and posts there);
- **by a second host collective** (:meth:`Hierarchy.reduce_private`): each worker holds a
  private buffer (a c10d backend's tensor), so the host sums again, the leader's buffer
  holding the hosts' result and the others' zeros: a broadcast inside the host at the
  cost of one pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from shmtrain.fabric.shm.host import HostGroup


class Hierarchy:
    """The host part, the leaders' part and the way back of one host-aware exchange.

    Args:
        host: this worker's host (a :class:`HostGroup` or a sub-group with its interface).
        leaders: the leaders' gloo group on a host's leader (registered with
            torch.distributed or a bare ``ProcessGroupGloo``); torch's non-member marker or
            None elsewhere.
        across: whether the job spans hosts (default: ``leaders`` is not None, which holds
            on every rank of a job that spans hosts, members included).
        tag: name fragment of the host channel the leader publishes on (asked for on
            every local rank, in the caller's order; None: nothing is published, e.g. a
            hierarchy built on the leaders alone).
    """

    def __init__(self, host: HostGroup, leaders: object | None, *, across: bool | None = None,
                 tag: str | None = None) -> None:
        self.host = host
        #: the leaders' group, on a host's leader of a job that spans hosts; else None
        # (torch's marker for a rank outside a group is an int)
        self.group: dist.ProcessGroup | None = None if leaders is None or isinstance(leaders, int) else leaders
        self.across = leaders is not None if across is None else across
        self.leader = host.local_rank == 0
        #: hosts in the job (known on the leaders; 1 on one host)
        self.hosts = self.group.size() if self.group is not None else 1
        self._published = host.channel(f"{tag}.published") if self.across and tag is not None else -1

    # -- the leaders' part ------------------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor, *, scale: float | None = None) -> None:
        """Leader: sum ``tensor`` in place with the other hosts' leaders (then times ``scale``)."""
        self._leaders().allreduce([tensor]).wait()
        if scale is not None:
            tensor.mul_(scale)

    def start_allreduce(self, tensor: torch.Tensor) -> dist.Work:
        """Leader: start the sum of ``tensor`` with the other leaders; the caller waits."""
        return self._leaders().allreduce([tensor])

    def all_gather(self, payload: torch.Tensor) -> list[torch.Tensor]:
        """Leader: every host's ``payload`` (equal shapes), in host order."""
        out = [torch.empty_like(payload) for _ in range(self.hosts)]
        self._leaders().allgather([out], [payload]).wait()
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Leader: host ``src``'s leader's ``tensor`` into every leader's."""
        options = dist.BroadcastOptions()
        options.rootRank = src
        self._leaders().broadcast([tensor], options).wait()

    def gather(self, tensor: torch.Tensor, into: list[torch.Tensor] | None) -> None:
        """Leader: every host's ``tensor`` into ``into`` on host 0's leader (None elsewhere)."""
        options = dist.GatherOptions()
        options.rootRank = 0
        self._leaders().gather([into] if into is not None else [], [tensor], options).wait()

    # -- the compositions -------------------------------------------------------------------
    def finish(self, step: int, *, local: Callable[[], None], across: Callable[[], None],
               what: str) -> None:
        """The host part is under way on every worker (each posted its share); finish
        ``step``. One host: ``local()`` (wait for the host's result). Across hosts: the
        leader waits ``local()``, runs ``across()`` (its leaders' part, on the shared
        result) and publishes; the other workers sleep until it has (``what`` names the
        wait in a timeout's message)."""
        if not self.across:
            local()
        elif self.leader:
            local()
            across()
            self.publish(step)
        else:
            self.receive(step, what)

    def reduce_private(self, buffer: torch.Tensor, host_sum: Callable[[torch.Tensor], None], *,
                       back: Callable[[], None] | None = None) -> None:
        """Sum every worker's private ``buffer`` over the job, in place: ``host_sum`` (a
        collective sum inside the host into every worker's buffer), the leaders' sum, then
        (after ``back()``, e.g. to name the way back in errors) ``host_sum`` again with
        zeros on every worker but the leader."""
        host_sum(buffer)
        if not self.across:
            return
        if self.group is not None:
            self.allreduce(buffer)
        if back is not None:
            back()
        if not self.leader:
            buffer.zero_()
        host_sum(buffer)

    # -- the way back --------------------------------------------------------------------------
    def publish(self, step: int) -> None:
        """Leader: the host's copy of the job's result of ``step`` is in place."""
        if self._published < 0:
            raise RuntimeError("this hierarchy publishes nothing (it was built without a tag)")
        self.host.control.post(self._published, self.host.local_rank, step)

    def receive(self, step: int, what: str) -> None:
        """Sleep until the host's leader has published ``step``."""
        self.host.control.wait(self._published, [0], step, timeout=self.host.timeout, what=what)

    def _leaders(self) -> dist.ProcessGroup:
        if self.group is None:
            raise RuntimeError("only a host's leader in a job across hosts talks to the other hosts' leaders")
        return self.group
