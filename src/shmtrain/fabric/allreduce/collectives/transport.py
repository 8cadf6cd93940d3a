"""Point-to-point transports that carry a schedule's transfers.

The interface is one call, :meth:`Transport.exchange`: post every send and receive of
a round, return when all are done (sends may be buffered). Two implementations:

- :class:`InProcessWorld` / :class:`InProcessTransport`: N peers inside one process
  (one thread each, one FIFO mailbox per ordered pair), for tests at any world size.
- :class:`GlooTransport`: torch.distributed ``isend``/``irecv`` over a process group
  (gloo on CPU), across processes and hosts.

The counting transport (:mod:`shmtrain.fabric.allreduce.collectives.counting`) is the third
way to run a schedule; it needs no data, so it runs every rank at once instead.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class TransportTimeout(TimeoutError):
    """A peer did not deliver (or take) a message within the timeout."""


class Transport:
    """Moves tensors between ranks; ``rank`` and ``world_size`` say who is who."""

    rank: int
    world_size: int
    timeout: float

    def exchange(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
    ) -> None:
        """Send each ``(peer, tensor)`` of ``sends`` and fill each ``(peer, tensor)`` of
        ``recvs`` from that peer, all at once; messages between two ranks arrive in the
        order they were sent. Raises :class:`TransportTimeout` naming the peer."""
        raise NotImplementedError


class InProcessWorld:
    """N peers in one process: unbounded FIFO mailboxes, one per (source, destination)."""

    def __init__(self, world_size: int, timeout: float = 60.0) -> None:
        if world_size < 1:
            raise ValueError(f"world size {world_size} must be at least 1")
        self.world_size = world_size
        self.timeout = timeout
        #: one queue per (sender, receiver) pair
        self.mailbox = {
            (s, d): queue.SimpleQueue() for s in range(world_size) for d in range(world_size)
        }

    def transport(self, rank: int) -> InProcessTransport:
        return InProcessTransport(self, rank)

    def run(self, fn: Callable[[InProcessTransport], Any]) -> list[Any]:
        """Call ``fn(transport)`` for every rank, each in its own thread; return the
        results by rank, or raise the first rank's error (the others time out or end)."""
        results: list[Any] = [None] * self.world_size
        errors: list[tuple[int, BaseException]] = []

        def body(rank: int) -> None:
            try:
                results[rank] = fn(self.transport(rank))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                errors.append((rank, exc))

        threads = [
            threading.Thread(target=body, args=(r,), name=f"peer-{r}", daemon=True)
            for r in range(self.world_size)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout * 2)
            if t.is_alive():
                raise TransportTimeout(f"in-process {t.name} did not finish in {self.timeout * 2}s")
        if errors:
            rank, exc = min(errors, key=lambda e: e[0])
            raise RuntimeError(f"in-process peer {rank} failed: {exc}") from exc
        return results


class InProcessTransport(Transport):
    """One peer of an :class:`InProcessWorld`; a send copies, so it never waits."""

    def __init__(self, world: InProcessWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.world_size = world.world_size
        self.timeout = world.timeout

    def exchange(self, sends, recvs) -> None:
        for peer, tensor in sends:
            self.world.mailbox[(self.rank, peer)].put(tensor.clone())
        for peer, tensor in recvs:
            try:
                message = self.world.mailbox[(peer, self.rank)].get(timeout=self.timeout)
            except queue.Empty:
                raise TransportTimeout(
                    f"rank {self.rank}: no message from peer {peer} within {self.timeout}s"
                ) from None
            if message.numel() != tensor.numel():
                raise RuntimeError(
                    f"rank {self.rank}: expected {tensor.numel()} elements from peer {peer}, "
                    f"got {message.numel()} (the ranks run different schedules)"
                )
            tensor.copy_(message)


class GlooTransport(Transport):
    """torch.distributed point-to-point (``isend``/``irecv``) over ``group``.

    Peers are ranks of ``group`` (the default group: global ranks).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, timeout: float = 120.0) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout = timeout
        self._wait = timedelta(seconds=timeout)

    def _global(self, peer: int) -> int:
        return peer if self.group is None else dist.get_global_rank(self.group, peer)

    def exchange(self, sends, recvs) -> None:
        works = [
            ("receive from", peer, dist.irecv(t, self._global(peer), group=self.group))
            for peer, t in recvs
        ]
        works += [
            ("send to", peer, dist.isend(t, self._global(peer), group=self.group))
            for peer, t in sends
        ]
        for verb, peer, work in works:
            try:
                work.wait(self._wait)
            except RuntimeError as exc:
                raise TransportTimeout(
                    f"rank {self.rank}: could not {verb} peer {peer} within "
                    f"{self.timeout}s ({exc})"
                ) from exc
