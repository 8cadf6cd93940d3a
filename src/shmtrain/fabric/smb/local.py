"""The shared memory buffer service on one host (SMB-API over POSIX shared memory).

ShmCaffe's Soft Memory Box (Section III-B, Figs. 2 and 5) for the workers of one host,
behind the :class:`~shmtrain.fabric.smb.api.BufferService` interface:

:class:`LocalBufferService` (the client)
    What a worker calls. The master creates a named buffer and hands out its key;
    other workers attach by key (Fig. 2); everyone reads and writes whole buffers; a
    worker asks the service to *accumulate* one buffer into another and is notified
    when that has been applied (Fig. 5).
:class:`BufferServer` (the memory server)
    The one owner that applies accumulations, exclusively, one request at a time. The
    local client of local rank 0 runs it in a thread; it reaches buffers only through a
    ``tensor_of(buffer_id)`` callable, so a memory server on another host can reuse it
    over another transport.
:class:`LocalProgressBoard` (the control information of Figs. 3-4, Section III-E)
    Every worker's iterations done, state and liveness, which termination alignment
    reads, kept in the host's control block. A service carries its clients' board as
    ``service.board``.

Accumulation is exclusive and done by ONE owner, never by the writer: each worker
writes its increment into a buffer only it writes (its ``weight_increment``, Fig. 5),
then posts a request in its own single-writer request slot (a sequence number). The
owner (the paper's memory server) drains the slots one request at a time, adds source
into destination, and posts the request's sequence number in the worker's "done"
word. No locks: every shared word has one writer, so an increment can be neither lost
nor applied twice, and a worker killed while writing its increment leaves nothing
half-applied (the owner only reads a slot once its sequence number is published).
Waiting sleeps on futex words.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from shmtrain.fabric.shm.control import DIED, ControlBlock, PeerFailure, PeerTimeout
from shmtrain.fabric.shm.futex import futex_wait, futex_wake
from shmtrain.fabric.shm.host import HostGroup
from shmtrain.fabric.shm.segment import SharedSegment, align
from shmtrain.fabric.smb.api import Buffer, BufferKey, BufferService, ProgressBoard, Ticket
from shmtrain.fabric.trust import UntrustedError

LINE = 64
_SLICE_S = 0.05  # how often a sleeper re-checks liveness and abort
_MAGIC = 0x534D4231  # "SMB1"

# -- request words: one writer per cache line ------------------------------------------
# line 0: magic and world; DOORBELL: written by every requester (a value no other request
# writes); APPLIED: the owner's count; then per client rank: its request slot (seq, src id,
# dst id), its done word (written by the owner), its closed word.
_DOORBELL, _APPLIED = 1, 2


def _idx(line: int, word: int = 0) -> int:
    return line * LINE // 4 + word


def _request_line(rank: int) -> int:
    return 3 + 3 * rank


def _done_line(rank: int) -> int:
    return 4 + 3 * rank


def _closed_line(rank: int) -> int:
    return 5 + 3 * rank


def _words_nbytes(world: int) -> int:
    return LINE * (3 + 3 * world)


class LocalProgressBoard(ProgressBoard):
    """The progress board of one host's workers, on the host's control block.

    Args:
        control: the host's control block (progress, state and pid words per local rank).
        rank: this worker's local rank.
        world: the host's local ranks.
    """

    def __init__(self, control: ControlBlock, rank: int, world: int) -> None:
        self.control = control
        self.rank = rank
        self.world = world

    def set_progress(self, iterations: int, state: int | None = None) -> None:
        self.control.set_progress(self.rank, iterations)
        if state is not None:
            self.control.set_state(self.rank, state)

    def progress(self, rank: int) -> int:
        return self.control.progress(rank)

    def state(self, rank: int) -> int:
        return self.control.state(rank)

    def alive(self, rank: int) -> bool:
        return self.control.alive(rank)


class BufferServer:
    """The memory server: applies accumulate requests exclusively, one at a time, round
    robin over the clients (ShmCaffe Fig. 5, T.A3; Fig. 6).

    It reads each client's single-writer request slot in ``words`` (a request is read
    only once its sequence number is published), adds source into destination, bumps the
    applied count and posts the sequence number in the client's done word, waking it.
    Between requests it sleeps on the doorbell word. A failure of the loop is kept in
    :attr:`failure` for the clients and :meth:`check` to surface.

    Args:
        words: the request words (int32), laid out as this module's ``_*_line`` say.
        base: the address of ``words[0]`` (for the futex calls).
        world: the clients.
        tensor_of: maps a buffer id to the server's tensor of that buffer (mapping it on
            first use); the only way the server reaches buffer bytes.
        name: the thread's name.
    """

    def __init__(
        self,
        words: np.ndarray,
        base: int,
        world: int,
        tensor_of: Callable[[int], torch.Tensor],
        *,
        name: str = "smb-owner",
    ) -> None:
        self.words = words
        self.base = base
        self.world = world
        self.tensor_of = tensor_of
        self.name = name
        self.failure: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        """True between :meth:`start` and :meth:`stop`."""
        return self._thread is not None

    def start(self) -> None:
        """Serve in a daemon thread."""
        if self._thread is not None:
            raise RuntimeError(f"{self.name}: the buffer server is already running")
        self._stop = False
        self._thread = threading.Thread(target=self.serve, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10) -> None:
        """Stop serving and join the thread (requests not yet applied stay unapplied);
        does not raise the loop's failure: :meth:`check` does."""
        self._stop = True
        futex_wake(self.base + _idx(_DOORBELL) * 4)
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            self._thread = None

    def check(self) -> None:
        """Raise :class:`PeerFailure` if the serving loop failed."""
        if self.failure is not None:
            raise PeerFailure(f"SMB owner thread failed: {self.failure!r}")

    def serve(self) -> None:
        """The loop: apply requests one at a time, round robin over the clients, until
        :meth:`stop` (a failure is recorded in :attr:`failure`, not raised)."""
        words = self.words
        bell = _idx(_DOORBELL)
        applied = _idx(_APPLIED)
        next_rank = 0
        try:
            while not self._stop:
                seen = int(words[bell])
                served = False
                for i in range(self.world):
                    rank = (next_rank + i) % self.world
                    seq = int(words[_idx(_request_line(rank))])
                    done_idx = _idx(_done_line(rank))
                    if seq <= int(words[done_idx]):
                        continue
                    req = _request_line(rank)
                    src = self.tensor_of(int(words[_idx(req, 1)]))
                    dst = self.tensor_of(int(words[_idx(req, 2)]))
                    dst.add_(src)
                    words[applied] += 1
                    words[done_idx] = seq
                    futex_wake(self.base + done_idx * 4)
                    served = True
                    next_rank = (rank + 1) % self.world
                    break  # one at a time; re-scan so no worker starves the others
                if not served:
                    futex_wait(self.base + bell * 4, seen, _SLICE_S)
        except BaseException as exc:  # noqa: BLE001 - surfaced to waiters and close()
            self.failure = exc


class LocalBufferService(BufferService):
    """The SMB service for the workers of one host, over POSIX shared memory.

    Construction is collective among the host's local ranks. Buffers are separate
    segments named ``<host prefix>-smb-<name>``; :meth:`ready` unlinks the names once
    everyone (the owner included) has them mapped, so nothing outlives the run. The
    owner's client runs the :class:`BufferServer` in a thread until :meth:`close`;
    ``board`` is a :class:`LocalProgressBoard` on the host's control block.

    Args:
        host: the host's workers; its control block carries progress and state.
        owner: local rank whose service thread applies accumulations.
        timeout: seconds any wait for a peer lasts (default: the host's).
    """

    def __init__(self, host: HostGroup, *, owner: int = 0, timeout: float | None = None) -> None:
        self.host = host
        self.control = host.control
        self.rank = host.local_rank
        self.world = host.local_world
        self.board = LocalProgressBoard(self.control, self.rank, self.world)
        self.owner = owner
        self.timeout = host.timeout if timeout is None else timeout
        nbytes = _words_nbytes(self.world)
        self._segment = host.allocate("smb", nbytes, _init_words(self.world))
        self._words = np.frombuffer(self._segment.buffer, dtype=np.int32, count=nbytes // 4)
        self._base = self._segment.address(0)
        self._segments: dict[int, SharedSegment] = {}
        self._tensors: dict[int, torch.Tensor] = {}
        self._created: list[SharedSegment] = []
        self._seq = 0
        self._pending: dict[int, Ticket] = {}  # source buffer id -> its last request
        self._server: BufferServer | None = None
        if self.rank == owner:
            self._server = BufferServer(self._words, self._base, self.world, self._tensor_of)
            self._server.start()

    @property
    def applied(self) -> int:
        """Accumulations the owner has applied so far (all workers)."""
        return int(self._words[_idx(_APPLIED)])

    # -- buffers ------------------------------------------------------------------
    def create(self, name: str, numel: int, dtype: torch.dtype = torch.float32) -> BufferKey:
        if numel <= 0:
            raise ValueError(f"buffer {name!r}: numel must be positive, got {numel}")
        store = self.host.store
        if store.add(f"smb/claim/{name}", 1) != 1:  # atomic: one creator per name
            raise ValueError(f"buffer name {name!r} is already taken on this service")
        buffer_id = store.add("smb/next", 1) - 1
        itemsize = torch.empty((), dtype=dtype).element_size()
        segment = SharedSegment(
            f"{self.host.prefix}-smb{buffer_id}-{name}"[:200], align(numel * itemsize), create=True
        )
        self._created.append(segment)
        key = BufferKey(name, buffer_id, numel, str(dtype).removeprefix("torch."), segment.name)
        self._segments[buffer_id] = segment
        self._tensors[buffer_id] = segment.tensor(dtype, 0, numel)
        store.set(f"smb/id/{buffer_id}", key.encode())
        store.set(f"smb/key/{name}", key.encode())
        return key

    def lookup(self, name: str) -> BufferKey:
        store = self.host.store
        deadline = time.monotonic() + self.timeout
        delay = 0.001
        while not store.check([f"smb/key/{name}"]):
            if time.monotonic() > deadline:
                raise PeerTimeout(f"no worker published SMB buffer {name!r} within {self.timeout:.0f} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return BufferKey.decode(store.get(f"smb/key/{name}"))

    def attach(self, key: BufferKey) -> Buffer:
        return Buffer(key, self._map(key))

    def _map(self, key: BufferKey) -> torch.Tensor:
        if key.id not in self._tensors:
            dtype = getattr(torch, key.dtype)
            itemsize = torch.empty((), dtype=dtype).element_size()
            if not key.locator.startswith(f"{self.host.prefix}-smb{key.id}-"):
                raise UntrustedError(
                    f"SMB buffer {key.name!r} is announced in the job's store at segment {key.locator[:80]!r}, "
                    f"not one of this run's ({self.host.prefix}-smb{key.id}-...): someone else wrote the "
                    "store; refused (docs/security.md)")
            segment = SharedSegment(key.locator, align(key.numel * itemsize), create=False)
            self._segments[key.id] = segment
            self._tensors[key.id] = segment.tensor(dtype, 0, key.numel)
        return self._tensors[key.id]

    def _tensor_of(self, buffer_id: int) -> torch.Tensor:
        """The server's view of a buffer by id (what :class:`BufferServer` is handed)."""
        if buffer_id not in self._tensors:  # created after ready(): its name still exists
            self._map(BufferKey.decode(self.host.store.get(f"smb/id/{buffer_id}")))
        return self._tensors[buffer_id]

    def ready(self) -> None:
        self.host.barrier("SMB buffers created")
        if self.rank == self.owner:  # the memory server maps every buffer before names go
            count = self.host.store.add("smb/next", 0)
            for buffer_id in range(count):
                if buffer_id not in self._tensors:
                    self._map(BufferKey.decode(self.host.store.get(f"smb/id/{buffer_id}")))
        self.host.barrier("SMB buffers attached")
        for segment in self._created:
            segment.unlink()

    def read(self, buffer: Buffer, out: torch.Tensor) -> torch.Tensor:
        out.copy_(buffer.storage)
        return out

    def write(self, buffer: Buffer, src: torch.Tensor) -> None:
        pending = self._pending.get(buffer.key.id)
        if pending is not None:
            self.wait(pending)
        buffer.storage.copy_(src)

    # -- accumulation through the owner -------------------------------------------
    def accumulate(self, src: Buffer, dst: Buffer) -> Ticket:
        if src.numel != dst.numel or src.key.dtype != dst.key.dtype:
            raise ValueError(f"cannot accumulate {src} into {dst}: sizes or dtypes differ")
        if self._seq:  # one request in flight per worker: its slot is single-entry
            self.wait(Ticket(self.rank, self._seq))
        words, req = self._words, _request_line(self.rank)
        self._seq += 1
        words[_idx(req, 1)] = src.key.id
        words[_idx(req, 2)] = dst.key.id
        words[_idx(req)] = self._seq  # publish last: the owner reads ids only after
        # A doorbell value no other request can write (seq*world+rank), so the owner
        # never sleeps through a request posted between its scan and its sleep.
        bell = _idx(_DOORBELL)
        words[bell] = (self._seq * self.world + self.rank) & 0x7FFFFFFF
        futex_wake(self._base + bell * 4)
        ticket = Ticket(self.rank, self._seq)
        self._pending[src.key.id] = ticket
        return ticket

    def done(self, ticket: Ticket) -> bool:
        return int(self._words[_idx(_done_line(ticket.rank))]) >= ticket.seq

    def wait(self, ticket: Ticket, timeout: float | None = None) -> None:
        timeout = self.timeout if timeout is None else timeout
        idx = _idx(_done_line(ticket.rank))
        deadline = time.monotonic() + timeout
        while True:
            value = int(self._words[idx])
            if value >= ticket.seq:
                return
            self._check_owner(f"the accumulate of request #{ticket.seq}")
            now = time.monotonic()
            if now >= deadline:
                raise PeerTimeout(
                    f"SMB owner (local rank {self.owner}, pid {self.control.pid(self.owner)}) did "
                    f"not apply request #{ticket.seq} of rank {ticket.rank} within {timeout:.0f} s"
                )
            futex_wait(self._base + idx * 4, value, min(_SLICE_S, deadline - now))

    def _check_owner(self, what: str) -> None:
        if self._server is not None:
            self._server.check()
        failed = self.control.aborted()
        if failed is not None:
            who, code = failed
            raise PeerFailure(f"local rank {who} failed (code {code}) while this worker waited for {what}", peer=who)
        if not self.board.alive(self.owner):
            self.control.abort(self.owner, DIED)  # the root cause, for every other waiter
            raise PeerFailure(
                f"SMB owner (local rank {self.owner}, pid {self.control.pid(self.owner)}) died "
                f"while this worker waited for {what}", peer=self.owner
            )

    def close(self) -> None:
        """Leave the service. The owner waits (sleeping, with a timeout naming the peer)
        until every other live worker has left, then stops its server thread."""
        if self._seq and self.board.alive(self.owner):
            try:
                self.wait(Ticket(self.rank, self._seq))
            except PeerFailure:
                pass
        for segment in self._created:  # buffers created after ready() still have names
            segment.unlink()
        closed = _idx(_closed_line(self.rank))
        self._words[closed] = 1
        futex_wake(self._base + closed * 4)
        server = self._server
        if server is None or not server.running:
            return
        try:
            deadline = time.monotonic() + self.timeout
            for rank in range(self.world):
                idx = _idx(_closed_line(rank))
                while not self._words[idx] and self.board.alive(rank):
                    if self.control.aborted() is not None:
                        break
                    now = time.monotonic()
                    if now >= deadline:
                        raise PeerTimeout(
                            f"local rank {rank} (pid {self.control.pid(rank)}) did not leave the "
                            f"SMB service within {self.timeout:.0f} s"
                        )
                    futex_wait(self._base + idx * 4, 0, min(_SLICE_S, deadline - now))
        finally:
            server.stop(timeout=10)
        server.check()


def _init_words(world: int):
    def init(segment: SharedSegment) -> None:
        words = np.frombuffer(segment.buffer, dtype=np.int32)
        words[:] = 0
        words[0] = _MAGIC
        words[1] = world

    return init
