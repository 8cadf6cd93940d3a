"""The shared memory buffer service's API (SMB-API): the types every transport shares.

ShmCaffe's Soft Memory Box (Section III-B, Figs. 2 and 5) as its clients see it:
:class:`BufferService` (named buffers, keys, read, write, accumulate with an update
notification), the :class:`BufferKey` a worker attaches by, the :class:`Buffer` handle,
the :class:`Ticket` of an accumulate in flight, the :class:`ProgressBoard` (the control
information of Figs. 3-4, Section III-E) and the worker states on it.

Transport neutrality: strategies hold a :class:`Buffer` handle and never touch its
bytes except through ``read``, ``write`` and ``accumulate``, and read progress through
a :class:`ProgressBoard`, so the remote service (SMB-REMOTE, another host's memory
server, :mod:`shmtrain.fabric.smb.remote`) can stand in for the local one
(:mod:`shmtrain.fabric.smb.local`) without a change in the strategies.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

import torch

# worker states in the control block (termination alignment reads them too)
STATE_SETUP, STATE_TRAINING, STATE_DONE = 0, 1, 2

@dataclass(frozen=True)
class BufferKey:
    """What a worker needs to attach a buffer: the paper's SHM key (Fig. 2).

    ``locator`` is transport specific (a segment name here, an address on a memory
    server later); everything else is the same for every transport.
    """

    name: str
    id: int
    numel: int
    dtype: str
    locator: str

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, text: str | bytes) -> BufferKey:
        return cls(**json.loads(text))


class Buffer:
    """A handle on one attached buffer; its bytes are reached through the service only."""

    def __init__(self, key: BufferKey, storage: object) -> None:
        self.key = key
        #: the transport's own handle of the data (a tensor view for the local service)
        self.storage = storage

    @property
    def numel(self) -> int:
        return self.key.numel

    def __repr__(self) -> str:
        return f"Buffer({self.key.name!r}, id={self.key.id}, numel={self.key.numel})"


@dataclass(frozen=True)
class Ticket:
    """An accumulate request in flight; :meth:`BufferService.wait` blocks until applied."""

    rank: int
    seq: int


class ProgressBoard(ABC):
    """Progress, state and liveness of every client of a buffer service (ShmCaffe's
    control information, Figs. 3-4; termination alignment, Section III-E).

    ``rank``/``world`` are the clients (the workers sharing the buffers); every call
    indexes workers by that rank. Each worker writes only its own entry; any worker may
    read every entry, without blocking.
    """

    rank: int
    world: int

    @abstractmethod
    def set_progress(self, iterations: int, state: int | None = None) -> None:
        """Publish this worker's iterations done (and state)."""

    @abstractmethod
    def progress(self, rank: int) -> int:
        """Iterations done by worker ``rank``."""

    @abstractmethod
    def state(self, rank: int) -> int:
        """``STATE_SETUP``, ``STATE_TRAINING`` or ``STATE_DONE`` of worker ``rank``."""

    @abstractmethod
    def alive(self, rank: int) -> bool:
        """False once worker ``rank`` is known to have died."""



class BufferService(ABC):
    """The SMB-API every transport implements (ShmCaffe Section III-B, Figs. 2 and 5).

    ``rank``/``world`` are the service's clients (the workers sharing the buffers);
    ``board`` holds their progress, state and liveness, indexed by the same rank.
    """

    rank: int
    world: int
    board: ProgressBoard

    @abstractmethod
    def create(self, name: str, numel: int, dtype: torch.dtype = torch.float32) -> BufferKey:
        """Create buffer ``name`` (zero-filled) and publish its key under that name."""

    @abstractmethod
    def lookup(self, name: str) -> BufferKey:
        """The key published under ``name`` (waits for the creator, with a timeout)."""

    @abstractmethod
    def attach(self, key: BufferKey) -> Buffer:
        """Map the buffer of ``key`` into this worker."""

    @abstractmethod
    def ready(self) -> None:
        """Collective: every worker has created and attached its buffers."""

    @abstractmethod
    def read(self, buffer: Buffer, out: torch.Tensor) -> torch.Tensor:
        """Copy the whole buffer into ``out`` (returns ``out``)."""

    @abstractmethod
    def write(self, buffer: Buffer, src: torch.Tensor) -> None:
        """Copy ``src`` into the whole buffer (waits for an accumulate still reading it)."""

    @abstractmethod
    def accumulate(self, src: Buffer, dst: Buffer) -> Ticket:
        """Ask the service to add ``src`` into ``dst`` exclusively; returns at once."""

    @abstractmethod
    def wait(self, ticket: Ticket, timeout: float | None = None) -> None:
        """Sleep until ``ticket``'s accumulate has been applied (the update notification)."""

    @abstractmethod
    def done(self, ticket: Ticket) -> bool:
        """True once ``ticket``'s accumulate has been applied."""

    @abstractmethod
    def close(self) -> None:
        """Leave the service; the owner keeps serving until every live peer has left."""

