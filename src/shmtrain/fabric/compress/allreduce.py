"""The compressed mean across hosts (``--compress``): dense inside a host, compressed on the link.

Per call, for a vector Δ_i on every worker i::

    Δ_h   = mean of the host's Δ_i                      shared memory (ShmAllreduce, no link)
    c_h   = C(Δ_h + e_h),  e_h ← Δ_h + e_h − D(c_h)     on the host's leader (fabric/compress/codec.py)
    [c_1 .. c_n] = all-gather of the c_h               the hosts' leaders, over gloo: the link
    Δ     = (1/n) Σ_h D(c_h)                            on every leader, identically
                                                        then published to the host's members

So each host's leader puts one payload of ``Codec.nbytes`` on the link per call (and
receives the others'), and the pseudo-gradient is compressed once per host, where the
host's workers have already averaged theirs for free. The all-gather of payloads is the
simple correct form: top-k places differ between hosts, so compressed vectors cannot be
summed as they travel (a ring allreduce of them would need a dense or growing payload).
On one host the payload does not leave it, but the same C, D and e apply, so a run
trains the same way on one host as on several (up to how many hosts average).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from shmtrain.fabric.allreduce.shared import ShmAllreduce
from shmtrain.fabric.compress.codec import Compressor, CompressSpec
from shmtrain.fabric.job.hierarchy import Hierarchy
from shmtrain.fabric.shm.host import HostGroup
from shmtrain.fabric.shm.segment import align
from shmtrain.fabric.shm.stitch import PAGE

#: the leaders' all-gather: this host's payload in, every host's payload out (host order)
Gather = Callable[[torch.Tensor], list[torch.Tensor]]


class HostBoard(Protocol):
    """A float32 vector every worker of a host reads, written by its leader."""

    def tensor(self) -> torch.Tensor: ...
    def post(self, step: int) -> None: ...
    def wait(self, step: int) -> None: ...
    def close(self) -> None: ...


class ShmBoard:
    """:class:`HostBoard` in the host's shared memory: one segment, one sequence word."""

    def __init__(self, host: HostGroup, numel: int, tag: str) -> None:
        self.host = host
        self.segment = host.allocate(tag, align(max(numel, 1) * 4, PAGE))
        self._tensor = self.segment.tensor(torch.float32, 0, numel)
        self._channel = host.channel(f"{tag}.published")

    def tensor(self) -> torch.Tensor:
        return self._tensor

    def post(self, step: int) -> None:
        self.host.control.post(self._channel, self.host.local_rank, step)

    def wait(self, step: int) -> None:
        self.host.control.wait(self._channel, [0], step, timeout=self.host.timeout,
                               what="the host leader's decompressed mean")

    def close(self) -> None:
        self._tensor = None  # type: ignore[assignment]
        self.segment.close()


class CompressedAllreduce:
    """The mean of every worker's vector with a compressed hop between hosts (the
    ``Allreduce`` interface: ``input()``, ``__call__()``, ``result()``, ``count``,
    ``close()``), and the error feedback as state (``state_dict``).

    Args:
        host_mean: the dense mean inside the host (its ``input()`` is this one's).
        board: where the leader publishes the result for the host's members.
        numel: elements of the vector.
        spec: the compression (``--compress``).
        leader: whether this worker is its host's leader (compresses and sends).
        gather: the leaders' all-gather of payloads; None on one host.
    """

    def __init__(self, host_mean: Any, board: HostBoard, numel: int, spec: CompressSpec, *,
                 leader: bool, gather: Gather | None) -> None:
        self.host_mean, self.board, self.leader, self.gather = host_mean, board, leader, gather
        self.spec = spec
        #: the leader's compression and error feedback (a member compresses nothing)
        self.compressor = Compressor(numel, spec) if leader else None
        self.count = 0
        #: payload bytes this worker handed the link (a leader's, with more than one host)
        self.link_bytes = 0

    def input(self, step: int | None = None) -> torch.Tensor:
        """This worker's slot for the next call: write Δ_i here."""
        return self.host_mean.input(step)

    def result(self, step: int | None = None) -> torch.Tensor:
        return self.board.tensor()

    def __call__(self) -> torch.Tensor:
        """The job's mean through the compressed hop; valid until this worker's next call."""
        host_mean = self.host_mean()  # every member arrives here first: the last result is read
        self.count += 1
        out = self.board.tensor()
        if not self.leader:
            self.board.wait(self.count)
            return out
        assert self.compressor is not None
        payload = self.compressor.encode(host_mean)
        if self.gather is None:
            payloads = [payload]
        else:
            payloads = self.gather(payload)
            self.link_bytes += payload.nbytes
        self.compressor.mean(payloads, out)
        self.board.post(self.count)
        return out

    def state_dict(self) -> dict[str, Any]:
        """The spec, the call count and the error feedback e_h (the leader's; None on a
        member, which has none)."""
        if self.compressor is None:
            return {"count": self.count, "spec": self.spec.text(), "error": None}
        return {"count": self.count, **self.compressor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the leader's error feedback (a checkpoint of other compression, or of a
        member where this worker leads, is refused by name)."""
        if self.compressor is not None:
            self.compressor.load_state_dict(state)
        elif state.get("spec") != self.spec.text():
            raise ValueError(f"the checkpoint's exchange was compressed with --compress {state.get('spec')}, "
                             f"this run's with --compress {self.spec.text()}: resume with the --compress "
                             "and the model the checkpoint was written with")

    def close(self) -> None:
        self.host_mean.close()
        self.board.close()


def shm_compressed_allreduce(host: HostGroup, leaders: dist.ProcessGroup | None, numel: int,
                             spec: CompressSpec, *, tag: str) -> CompressedAllreduce:
    """The shared-memory build: ShmAllreduce inside the host (no leaders: it stays in the
    host), a :class:`ShmBoard`, and the leaders' gloo all-gather across hosts
    (:meth:`Hierarchy.all_gather <shmtrain.fabric.job.hierarchy.Hierarchy.all_gather>`)."""
    hierarchy = Hierarchy(host, leaders)
    across = hierarchy.group is not None and hierarchy.hosts > 1
    return CompressedAllreduce(
        ShmAllreduce(host, numel, dtype=torch.float32, op="mean", tag=f"{tag}.host"),
        ShmBoard(host, numel, f"{tag}.out"), numel, spec, leader=hierarchy.leader,
        gather=hierarchy.all_gather if across else None)
