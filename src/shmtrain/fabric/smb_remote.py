"""SMB-REMOTE: the buffer service for workers on other hosts (ShmCaffe III-B, Figs. 2, 5, 7).

ShmCaffe's workers on many nodes reach one *remote* memory server that owns the global
buffers and applies every accumulation itself, exclusively, one request at a time
(Fig. 5). :class:`MemoryServer` is that process; :class:`RemoteBufferService` is the
client, behind the same :class:`~shmtrain.fabric.smb.BufferService` interface as the
local shared-memory service, so no strategy changes to use it.

Transport: gloo point-to-point on a process group of its own (the server is rank 0,
job rank ``r`` is ``1 + r``), over a TCP store the server hosts. torch RPC (TensorPipe)
was measured on the same loopback link and moved 4 MiB in 4-6.5 ms where gloo's
send/recv took 2.4 ms, so gloo it is (docs/async.md, "The remote buffer service").
Gloo's any-source receive keeps serving the other clients when one dies (measured).

Protocol: every request is one header (``int64[8]``: op, sequence number, arguments)
on tag ``REQUEST``; the server answers every header with a status reply (``int64[4]``)
on tag ``REPLY`` *before* any payload moves, so a refused or malformed request never
leaves bytes in flight: ``write`` sends its payload after an OK, ``read`` receives the
buffer after an OK, ``accumulate`` is answered when applied (the update notification of
Fig. 5). A client's requests are served in the order it sent them.

Security: the server listens on loopback unless told otherwise; a non-loopback bind
needs a shared secret, and then every client proves it (HMAC-SHA256 of a nonce the
server publishes) before its first buffer operation; a client that has not is refused
with a logged reason and nothing changes.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from shmtrain.fabric.control import PeerFailure, PeerTimeout, first_line
from shmtrain.fabric.netif import route_source
from shmtrain.fabric.smb import (
    STATE_SETUP,
    Buffer,
    BufferKey,
    BufferService,
    ProgressBoard,
    Ticket,
)

HEADER, REPLY_WORDS = 8, 4
TAG_REQUEST, TAG_TO_SERVER = 1, 3
#: the tag of the receive the server keeps posted on each client's link: a client sends
#: one byte there just before its goodbye; the receive failing first means the link closed,
#: which is how a lost client is seen
TAG_LIVENESS = 5
_REPLY, _TO_CLIENT, _PAYLOAD_IN, _VERDICT = 0, 1, 2, 3


def _tag(seq: int, kind: int) -> int:
    """The tag of request ``seq``'s reply, payload to the client, or payload to the server:
    one per request, so a client posts its receives before it sends the header (no
    round trip waits for a receive to be posted) and a receive left posted after a
    refusal can never take a later message."""
    return 16 + ((seq % (1 << 22)) << 2) + kind
OP_HELLO, OP_READ, OP_WRITE, OP_ACCUMULATE, OP_BYE = 1, 2, 3, 4, 5
OK, REFUSED, BAD_REQUEST = 0, 1, 2
_STATUS = {REFUSED: "refused: this client has not proven the shared secret",
           BAD_REQUEST: "malformed request"}
SECRET_ENV = "SHMTRAIN_SECRET"
#: the server's group timeout: its any-source receive of the next request must never time
#: out (gloo loses the messages of a link after a timed-out receive: measured), so it is
#: effectively unbounded; connecting and every payload have their own bound
_FOREVER = datetime.timedelta(days=365)
#: the largest refused or malformed write payload the server receives only to drop it
_DROP_MAX = 1 << 30


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP or ``localhost``) is a loopback address."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def read_secret(secret_file: str | None) -> bytes | None:
    """The shared secret from ``secret_file`` or ``$SHMTRAIN_SECRET``; None when neither."""
    if secret_file:
        data = Path(secret_file).read_bytes().strip()
        if not data:
            raise ValueError(f"--secret-file {secret_file}: the file is empty; write a secret into it "
                             "(e.g. `openssl rand -hex 32 > FILE`)")
        return data
    env = os.environ.get(SECRET_ENV, "")
    return env.encode() if env else None


def _proof(secret: bytes, nonce: str) -> torch.Tensor:
    digest = hmac.new(secret, nonce.encode(), hashlib.sha256).digest()
    return torch.frombuffer(bytearray(digest), dtype=torch.uint8)


def _gloo(store: dist.Store, rank: int, size: int, host: str, timeout: datetime.timedelta) -> dist.ProcessGroup:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(dist.PrefixStore("smb/pg/", store), rank, size, options)


class MemoryServer:
    """The memory server: owns the global buffers, applies requests one at a time.

    Args:
        clients: the job's workers (every one connects before serving starts).
        bind: address to listen on (loopback by default).
        port: port of the server's store (0: any free one; see :attr:`port`).
        secret: shared secret every client must prove; required for a non-loopback bind.
        timeout: seconds to wait for the clients to connect.
        log: where reasons for refusals and errors go.
        resume: a snapshot file (:meth:`snapshot`) to start the buffers from.
    """

    def __init__(self, clients: int, *, bind: str = "127.0.0.1", port: int = 0, secret: bytes | None = None,
                 timeout: float = 120.0, log: Callable[[str], None] = print, resume: str | None = None) -> None:
        if clients < 1:
            raise ValueError(f"--clients {clients}: at least one client (the job's workers) is needed")
        if not is_loopback(bind) and not secret:
            raise ValueError(f"--bind {bind}: a memory server on a non-loopback address needs a shared secret; "
                             f"pass --secret-file FILE or set {SECRET_ENV} (clients need the same)")
        self.clients, self.bind, self.secret, self.log = clients, bind, secret, log
        self.timeout = timeout
        self._bound = datetime.timedelta(seconds=timeout)  # one payload or reply to one client
        self.store = dist.TCPStore(bind, port, None, True, datetime.timedelta(seconds=timeout),
                                   wait_for_workers=False)
        self.port = self.store.port
        self.nonce = secrets.token_hex(16)
        self.buffers: dict[int, torch.Tensor] = {}
        self.applied = 0
        self.refused = 0
        self.errors = 0
        #: clients whose link closed before they said goodbye (rank -> when), also
        #: recorded as ``smb/dead/<rank>`` in the store for the other workers' boards
        self.lost: dict[int, float] = {}
        self._trusted: set[int] = set() if secret else set(range(1, clients + 1))
        self._left: set[int] = set()
        self._lock = threading.Lock()  # buffers: the serving loop vs snapshots
        self.last_request = time.monotonic()
        # per client: its payloads in flight, oldest first (kind, work, tensor, buffer id,
        # finished, failure): one, or two writes (the older one still being applied)
        self._inflight: dict[int, list[tuple]] = {}
        self._writes: dict[int, int] = {}  # per client: writes so far (their staging slot)
        self._state = threading.RLock()  # requests vs reap(): clients, transfers in flight
        self._copies: dict[tuple[int, int], torch.Tensor | None] = {}  # (client, slot) -> staging tensor
        self._pg: dist.ProcessGroup | None = None
        self._watchers: dict[int, threading.Thread] = {}
        self._drops: list[threading.Thread] = []  # receives of refused writes' payloads
        self._sending: dict[int, int] = {}  # id(tensor) -> reads in flight from it
        self.store.set("smb/clients", str(clients))
        self.store.set("smb/nonce", self.nonce)
        self.store.set("smb/secret", "1" if secret else "0")
        if resume:
            self._resume(resume)

    @property
    def address(self) -> str:
        return f"{self.bind}:{self.port}"

    @property
    def remaining(self) -> int:
        """Clients that have neither said goodbye nor been lost."""
        return self.clients - len(self._left)

    @property
    def finished(self) -> bool:
        """Every client has said goodbye or been lost."""
        return len(self._left) >= self.clients

    # -- buffers ---------------------------------------------------------------------
    def _buffer(self, buffer_id: int) -> torch.Tensor | None:
        tensor = self.buffers.get(buffer_id)
        if tensor is None and self.store.check([f"smb/id/{buffer_id}"]):
            key = BufferKey.decode(self.store.get(f"smb/id/{buffer_id}"))
            tensor = self.buffers[buffer_id] = torch.zeros(key.numel, dtype=getattr(torch, key.dtype))
        return tensor

    def snapshot(self, path: str | Path) -> None:
        """Write every buffer and its key to ``path`` atomically (temporary file, fsync, rename)."""
        path = Path(path)
        with self._lock:
            state = {"keys": {i: self.store.get(f"smb/id/{i}").decode() for i in self.buffers},
                     "buffers": {i: t.clone() for i, t in self.buffers.items()}, "applied": self.applied}
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def _resume(self, path: str) -> None:
        state = torch.load(path, weights_only=True)
        for buffer_id, text in state["keys"].items():
            key = BufferKey.decode(text)
            self.store.set(f"smb/id/{buffer_id}", text)
            self.store.set(f"smb/key/{key.name}", text)
            self.store.add(f"smb/claim/{key.name}", 1)
            self.buffers[int(buffer_id)] = state["buffers"][buffer_id]
        self.store.add("smb/next", len(state["keys"]))
        self.applied = int(state.get("applied", 0))

    # -- serving -----------------------------------------------------------------------
    def serve(self) -> None:
        """Connect every client (unless :meth:`connect` did), then serve until each has
        said goodbye."""
        pg = self._pg if self._pg is not None else self.connect()
        header = torch.zeros(HEADER, dtype=torch.int64)
        while len(self._left) < self.clients:
            try:
                work = pg.recv_anysource([header], TAG_REQUEST)
                work.wait()
                source = work._source_rank()
            except RuntimeError as exc:  # a truncated header, or a client gone mid-message
                self.errors += 1
                self.log(f"shmtrain smb-server: a request could not be received ({first_line(exc)}); serving on")
                continue
            self.last_request = time.monotonic()
            with self._state:
                self._settle(block=False)  # payloads that have arrived, from anyone
                if source in self._left:
                    continue
                try:
                    # its own earlier transfers come first; a write may follow a write still
                    # being applied (its watcher applies them in order)
                    self._settle_client(source, block=True, keep_write=int(header[0]) == OP_WRITE)
                    self._handle(source, header)
                except RuntimeError as exc:
                    self._lose(source, exc)
        self.reap()

    def connect(self) -> dist.ProcessGroup:
        """Form the server's process group with every client (within ``timeout``)."""
        made: list[dist.ProcessGroup] = []
        connect = threading.Thread(target=lambda: made.append(_gloo(self.store, 0, self.clients + 1, self.bind, _FOREVER)),
                                   name="smb-connect", daemon=True)
        connect.start()
        connect.join(self.timeout)
        if not made:
            joined = self.store.add("smb/joined", 0)
            raise PeerTimeout(f"only {joined} of {self.clients} clients connected to the memory server at "
                              f"{self.address} within {self.timeout:.0f} s")
        self._pg = made[0]
        for client in range(1, self.clients + 1):
            self._watch_link(client)
        return self._pg

    def _watch_link(self, client: int) -> None:
        """Notice ``client``'s death while it is idle: a receive that no message ever
        completes stays posted on its link; gloo fails it as soon as the link closes
        (measured: at once after SIGKILL), while a client that said goodbye first is only
        leaving. A lost client is marked ``smb/dead/<rank>`` so the survivors' boards
        (TERM) stop counting on it."""
        assert self._pg is not None
        work = self._pg.recv([torch.zeros(1, dtype=torch.uint8)], client, TAG_LIVENESS)

        def watch() -> None:
            try:
                work.wait(_FOREVER)  # the byte before a goodbye: this client is leaving
            except RuntimeError as exc:
                with self._state:
                    if client in self._left:
                        return
                    if self._inflight.get(client):  # the same loss the transfer's watcher sees
                        self._lose(client, exc)
                        return
                    self._left.add(client)
                self._record_lost(client)
                self.log(f"shmtrain smb-server: client {client - 1} lost (its link closed: {first_line(exc)}); "
                         "what it applied stays; serving the others")

        self._watchers[client] = thread = threading.Thread(target=watch, name=f"smb-alive-{client}", daemon=True)
        thread.start()

    @property
    def watching(self) -> int:
        """Threads still waiting in gloo (link watchers of clients that neither said
        goodbye properly nor were lost, receives of dropped payloads): gloo aborts a
        process that exits while one waits, so the caller leaves with ``os._exit`` then."""
        return sum(t.is_alive() for t in [*self._watchers.values(), *self._drops])

    def reap(self) -> None:
        """Apply the payloads that have arrived and drop the clients lost mid-transfer
        (called between requests, and by the server's main thread while it waits for one)."""
        with self._state:
            self._settle(block=False)

    def _copy(self, client: int, like: torch.Tensor) -> tuple[tuple[int, int], torch.Tensor]:
        """This client's next staging slot and tensor for a write like ``like``: two per
        client, used in turn, so a write lands while the one before it is still being
        applied (kept: a new 4 MiB tensor per request costs its page faults every time)."""
        slot = self._writes.get(client, 0)
        self._writes[client] = slot + 1
        key = (client, slot % 2)
        copy = self._copies.get(key)
        if copy is None or copy.numel() != like.numel() or copy.dtype != like.dtype:
            copy = self._copies[key] = torch.empty_like(like)
        return key, copy

    def _track(self, client: int, kind: str, work: dist.Work, tensor: torch.Tensor, buffer_id: int,
               slot: tuple[int, int] | None = None) -> None:
        """Watch a payload in flight: gloo reports a transfer's end (or its peer's death)
        only to a waiter, so one short-lived thread waits for it. A write that has arrived
        whole becomes the buffer (its staging tensor and the old buffer trade places, no
        copy); ``slot`` is the staging slot the old buffer takes."""
        finished, failure = threading.Event(), []
        entries = self._inflight.setdefault(client, [])
        before = entries[-1] if entries else None  # a write still being applied

        def watch() -> None:
            try:
                work.wait()
                if kind == "write":  # every byte has arrived: apply it whole, off the request path
                    if before is not None:
                        before[4].wait()  # in the client's order
                    if before is None or not before[5]:
                        with self._lock:
                            old, self.buffers[buffer_id] = self.buffers[buffer_id], tensor
                            # a read still sending the old tensor keeps it out of the slots
                            self._copies[slot] = None if self._sending.get(id(old)) else old
            except RuntimeError as exc:
                failure.append(exc)
            finally:
                if kind == "read":
                    with self._lock:
                        left = self._sending.pop(id(tensor), 1) - 1
                        if left:
                            self._sending[id(tensor)] = left
                finished.set()

        entries.append((kind, work, tensor, buffer_id, finished, failure))
        threading.Thread(target=watch, name=f"smb-{kind}-{client}", daemon=True).start()

    def _lose(self, client: int, exc: BaseException) -> None:
        """Client ``client``'s link broke mid-request: drop it; the others go on."""
        self.errors += 1
        self._left.add(client)
        self._inflight.pop(client, None)
        self._record_lost(client)
        self.log(f"shmtrain smb-server: client {client - 1} lost in the middle of a request "
                 f"({first_line(exc)}); nothing of it was applied; serving the others")

    def _record_lost(self, client: int) -> None:
        self.lost[client - 1] = time.time()
        try:
            self.store.set(f"smb/dead/{client - 1}", "1")
        except RuntimeError:  # the store is this process's own: only at shutdown
            pass

    def _settle(self, block: bool) -> None:
        for client in list(self._inflight):
            try:
                self._settle_client(client, block)
            except RuntimeError as exc:
                self._lose(client, exc)

    def _settle_client(self, client: int, block: bool, keep_write: bool = False) -> None:
        """Finish ``client``'s payloads in flight (``keep_write``: all but a last write): a
        write is applied only once every byte has arrived (into a staging copy), so a
        client lost mid-payload changes nothing."""
        entries = self._inflight.get(client)
        while entries:
            if keep_write and len(entries) == 1 and entries[0][0] == "write":
                return
            entry = entries[0]
            if not block and not entry[4].is_set():
                return
            entry[4].wait()
            entries.pop(0)
            if entry[5]:
                raise entry[5][0]

    def _reply(self, client: int, status: int, seq: int, value: int = 0, kind: int = _REPLY) -> None:
        assert self._pg is not None
        self._pg.send([torch.tensor([status, seq, value, 0], dtype=torch.int64)], client,
                      _tag(seq, kind)).wait(self._bound)

    def _handle(self, client: int, header: torch.Tensor) -> None:
        op, seq, a, b, c = (int(x) for x in header[:5])
        pg = self._pg
        assert pg is not None
        if op == OP_HELLO:
            proof = torch.zeros(32, dtype=torch.uint8)
            self._reply(client, OK, seq)  # then the proof
            pg.recv([proof], client, TAG_TO_SERVER).wait(min(self._bound, datetime.timedelta(seconds=10)))
            expected = _proof(self.secret, self.nonce) if self.secret else proof
            if hmac.compare_digest(bytes(proof.tolist()), bytes(expected.tolist())):
                self._trusted.add(client)
                self._reply(client, OK, seq, kind=_VERDICT)
            else:
                self.refused += 1
                self.log(f"shmtrain smb-server: client {client - 1} refused: its proof of the shared secret is wrong")
                self._reply(client, REFUSED, seq, kind=_VERDICT)
            return
        if op == OP_BYE:
            self._left.add(client)
            watcher = self._watchers.get(client)
            if watcher is not None:  # its byte came before the goodbye on the same link
                watcher.join(5.0)
            self._reply(client, OK, seq)
            return
        if client not in self._trusted:
            self.refused += 1
            self.log(f"shmtrain smb-server: client {client - 1} refused (op {op}): it has not proven the shared secret")
            drained = op == OP_WRITE and self._drop_payload(client, seq, a, b)
            self._reply(client, REFUSED, seq, int(drained))
            return
        if op in (OP_READ, OP_WRITE):
            with self._lock:  # a read counts as in flight from the buffer it takes, at once
                tensor = self._buffer(a)
                if tensor is not None and b == tensor.numel() and op == OP_READ:
                    self._sending[id(tensor)] = self._sending.get(id(tensor), 0) + 1
            if tensor is None or b != tensor.numel():
                drained = op == OP_WRITE and self._drop_payload(client, seq, a, b)
                return self._bad(client, seq, f"op {op} on buffer {a} with {b} elements: no such buffer", drained)
            # the payload moves while the server serves the others (a stalled client blocks
            # no one): a read is sent from the buffer itself, like the paper's RDMA read
            # (not atomic against an accumulate applied meanwhile, as with the local
            # service); a write lands in a staging copy applied whole once it has arrived,
            # whose receive is posted before the status, so the payload follows at once
            if op == OP_READ:
                self._reply(client, OK, seq)
                self._track(client, "read", pg.send([tensor], client, _tag(seq, _TO_CLIENT)), tensor, a)
            else:
                slot, copy = self._copy(client, tensor)  # a slot whose last transfer was settled
                self._track(client, "write", pg.recv([copy], client, _tag(seq, _PAYLOAD_IN)), copy, a, slot)
                self._reply(client, OK, seq)
            return
        if op == OP_ACCUMULATE:
            src, dst = self._buffer(a), self._buffer(b)
            if src is None or dst is None or src.numel() != dst.numel() or src.dtype != dst.dtype:
                return self._bad(client, seq, f"accumulate {a} into {b}: unknown buffers or sizes differ")
            with self._lock:  # the buffers as they are now (a write that arrived replaces one)
                self.buffers[b].add_(self.buffers[a])  # exclusive: the one serving thread applies it, once
                self.applied += 1
            self._reply(client, OK, seq, self.applied)
            return
        self._bad(client, seq, f"unknown op {op}")

    def _drop_payload(self, client: int, seq: int, buffer_id: int, numel: int) -> bool:
        """A write's payload follows its header at once (the client does not wait for the
        status): for a refused or malformed write of a buffer the server holds it is
        received into scratch and dropped, so the client's send ends and nothing changes;
        True when such a receive was posted (the status says so: the client then waits for
        its send, else it abandons it). The receive is watched apart from the client's
        transfers: a client that never sends that payload stalls no one, and a claim
        larger than the server's largest buffer gets no receive."""
        known = self.buffers.get(buffer_id)
        if known is None or not 0 < numel <= max(t.numel() for t in self.buffers.values() if t.dtype == known.dtype):
            return False
        assert self._pg is not None
        work = self._pg.recv([torch.empty(numel, dtype=known.dtype)], client, _tag(seq, _PAYLOAD_IN))

        def drop() -> None:
            try:
                work.wait()
            except RuntimeError:
                pass  # the client's link broke: its watcher reports it

        thread = threading.Thread(target=drop, name=f"smb-drop-{client}", daemon=True)
        self._drops.append(thread)
        thread.start()
        return True

    def _bad(self, client: int, seq: int, why: str, drained: bool = False) -> None:
        self.errors += 1
        self.log(f"shmtrain smb-server: client {client - 1}: {why}; answered with an error")
        self._reply(client, BAD_REQUEST, seq, int(drained))


class StoreProgressBoard(ProgressBoard):
    """Progress, state and liveness of the remote service's clients, in the server's store
    (one key per worker: iterations and state; ``smb/dead/<rank>`` once it is known lost).
    A failure to reach the store is a :class:`PeerFailure` naming the server (``lost``)."""

    def __init__(self, store: dist.Store, rank: int, world: int,
                 lost: Callable[[RuntimeError, str], Exception] | None = None) -> None:
        self.store, self.rank, self.world = store, rank, world
        self._lost = lost
        self._state = STATE_SETUP
        self.set_progress(0, STATE_SETUP)

    def _do(self, fn: Callable, what: str):
        try:
            return fn()
        except RuntimeError as exc:
            if self._lost is None:
                raise
            raise self._lost(exc, what) from None

    def set_progress(self, iterations: int, state: int | None = None) -> None:
        if state is not None:
            self._state = state
        self._do(lambda: self.store.set(f"smb/progress/{self.rank}", f"{iterations},{self._state}"),
                 "publishing progress")

    def _record(self, rank: int) -> tuple[int, int]:
        key = f"smb/progress/{rank}"
        text = self._do(lambda: self.store.get(key).decode() if self.store.check([key]) else None,
                        "reading progress")
        if text is None:
            return 0, STATE_SETUP
        iterations, state = text.split(",")
        return int(iterations), int(state)

    def progress(self, rank: int) -> int:
        return self._record(rank)[0]

    def state(self, rank: int) -> int:
        return self._record(rank)[1]

    def alive(self, rank: int) -> bool:
        return not self._do(lambda: self.store.check([f"smb/dead/{rank}"]), "reading liveness")

    def mark_dead(self, rank: int) -> None:
        """Record that worker ``rank`` is lost (its host's launcher saw it die)."""
        self._do(lambda: self.store.set(f"smb/dead/{rank}", "1"), "recording a lost worker")


class RemoteBufferService(BufferService):
    """The SMB service through a :class:`MemoryServer` (ShmCaffe's remote SMB, Fig. 7).

    Construction connects to the server (collective among the job's workers: the
    server's process group forms when every client has joined).

    Args:
        address: ``HOST:PORT`` of the server's store.
        rank: this worker's rank in the job; world: the job's workers.
        secret: the shared secret (when the server asks for one).
        timeout: seconds any request or connection waits before naming the server.
    """

    def __init__(self, address: str, rank: int, world: int, *, secret: bytes | None = None,
                 timeout: float = 120.0) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--smb-server {address!r} must be HOST:PORT, e.g. 127.0.0.1:29600")
        self.address, self.rank, self.world, self.timeout = address, rank, world, timeout
        delta = datetime.timedelta(seconds=timeout)
        try:
            self.store = dist.TCPStore(host, int(port), None, False, delta)
        except (RuntimeError, dist.DistError) as exc:
            raise PeerFailure(f"cannot reach the memory server at {address} ({first_line(exc)}); start it with "
                              f"`shmtrain smb-server --port {port} --clients {world}` or fix --smb-server") from None
        clients = int(self.store.get("smb/clients"))
        if clients != world:
            raise ValueError(f"the memory server at {address} serves {clients} workers but this job has {world}; "
                             f"restart it with --clients {world}")
        self._lock = threading.Lock()
        self._seq = 0
        self._pending: list[tuple[Ticket, dist.Work, torch.Tensor]] = []
        self._done = 0
        self.board = StoreProgressBoard(self.store, rank, world, self._lost)
        self.store.add("smb/joined", 1)
        self.pg = self._call(lambda: _gloo(self.store, 1 + rank, world + 1, route_address(host), delta),
                             "connecting")
        if self.store.get("smb/secret") == b"1":
            try:
                if secret is None:
                    raise PermissionError(f"the memory server at {address} requires a shared secret: pass "
                                          f"--secret-file FILE or set {SECRET_ENV}")
                self._hello(secret, self.store.get("smb/nonce").decode())
            except PermissionError:
                self.close()  # leave, so the server does not wait for this client
                raise

    # -- requests --------------------------------------------------------------------
    def _call(self, fn: Callable, what: str):
        try:
            return fn()
        except RuntimeError as exc:
            raise self._lost(exc, what) from None

    def _lost(self, exc: RuntimeError, what: str) -> Exception:
        """The error for a failed transfer to or from the server, naming it."""
        text = str(exc)
        if any(s in text for s in ("Connection closed", "Connection reset", "Broken pipe", "Connection refused")):
            return PeerFailure(f"the memory server at {self.address} was lost (its connection closed: it died "
                               f"or was stopped) while {what}; restart it, with --resume from its "
                               "snapshot if it wrote one")
        if "Timed out" in text or "timed out" in text:
            return PeerTimeout(f"the memory server at {self.address} did not answer within "
                               f"{self.timeout:.0f} s while {what}")
        return PeerFailure(f"the memory server at {self.address} failed while {what}: {first_line(exc)}")

    def _request(self, op: int, a: int = 0, b: int = 0, c: int = 0,
                 landing: torch.Tensor | None = None) -> tuple[int, tuple[dist.Work, torch.Tensor], dist.Work | None]:
        """Post the receive of the reply (and of a read's payload into ``landing``), then
        send one header; returns the sequence number, the reply's (work, tensor) and the
        payload's work (the caller holds the lock)."""
        self._seq += 1
        seq = self._seq
        reply = torch.zeros(REPLY_WORDS, dtype=torch.int64)
        posted = (self._call(lambda: self.pg.recv([reply], 0, _tag(seq, _REPLY)), "posting a receive"), reply)
        payload = None
        if landing is not None:
            payload = self._call(lambda: self.pg.recv([landing], 0, _tag(seq, _TO_CLIENT)), "posting a receive")
        header = torch.tensor([op, seq, a, b, c, 0, 0, 0], dtype=torch.int64)
        self._call(lambda: self.pg.send([header], 0, TAG_REQUEST).wait(), f"sending request #{seq}")
        return seq, posted, payload

    def _status(self, seq: int, posted: tuple[dist.Work, torch.Tensor], what: str) -> torch.Tensor:
        work, reply = posted
        self._call(work.wait, f"waiting for the answer to {what}")
        self._check(reply, seq, what)
        return reply

    def _check(self, reply: torch.Tensor, seq: int, what: str) -> None:
        status, echoed = int(reply[0]), int(reply[1])
        if echoed != seq:
            raise PeerFailure(f"the memory server at {self.address} answered request #{echoed} "
                              f"while this worker expected #{seq} ({what})")
        if status == REFUSED:
            raise PermissionError(f"the memory server at {self.address} refused {what}: {_STATUS[REFUSED]}")
        if status != OK:
            raise ValueError(f"the memory server at {self.address} rejected {what}: "
                             f"{_STATUS.get(status, f'status {status}')} (see the server's log)")

    def _drain(self) -> None:
        """Collect the answers of accumulates in flight (before any other answer)."""
        while self._pending:
            self._drain_one()

    def _hello(self, secret: bytes, nonce: str) -> None:
        with self._lock:
            seq, posted, _ = self._request(OP_HELLO)
            self._status(seq, posted, "the greeting")
            second = torch.zeros(REPLY_WORDS, dtype=torch.int64)
            verdict = (self._call(lambda: self.pg.recv([second], 0, _tag(seq, _VERDICT)),
                                  "posting a receive"), second)
            proof = _proof(secret, nonce)
            self._call(lambda: self.pg.send([proof], 0, TAG_TO_SERVER).wait(), "proving the secret")
            self._status(seq, verdict, "the proof of the shared secret")

    # -- the SMB API -----------------------------------------------------------------
    def create(self, name: str, numel: int, dtype: torch.dtype = torch.float32) -> BufferKey:
        if numel <= 0:
            raise ValueError(f"buffer {name!r}: numel must be positive, got {numel}")
        if self.store.add(f"smb/claim/{name}", 1) != 1:
            raise ValueError(f"buffer name {name!r} is already taken on the memory server at {self.address}")
        buffer_id = self.store.add("smb/next", 1) - 1
        key = BufferKey(name, buffer_id, numel, str(dtype).removeprefix("torch."), f"{self.address}/{buffer_id}")
        self.store.set(f"smb/id/{buffer_id}", key.encode())
        self.store.set(f"smb/key/{name}", key.encode())
        return key

    def lookup(self, name: str) -> BufferKey:
        deadline = time.monotonic() + self.timeout
        delay = 0.001
        while not self.store.check([f"smb/key/{name}"]):
            if time.monotonic() > deadline:
                raise PeerTimeout(f"no worker published SMB buffer {name!r} on {self.address} within {self.timeout:.0f} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return BufferKey.decode(self.store.get(f"smb/key/{name}"))

    def attach(self, key: BufferKey) -> Buffer:
        return Buffer(key, None)

    def ready(self) -> None:
        count = self.store.add("smb/ready", 1)
        deadline = time.monotonic() + self.timeout
        generation = -(-count // self.world) * self.world
        while self.store.add("smb/ready", 0) < generation:
            if time.monotonic() > deadline:
                raise PeerTimeout(f"only {self.store.add('smb/ready', 0) % self.world} of {self.world} workers "
                                  f"created their buffers on {self.address} within {self.timeout:.0f} s")
            time.sleep(0.005)

    def read(self, buffer: Buffer, out: torch.Tensor) -> torch.Tensor:
        # gloo receives into host memory: a GPU ``out`` gets the data through a host landing
        target = (out if out.is_contiguous() and out.dtype == getattr(torch, buffer.key.dtype)
                  and out.device.type == "cpu" else None)
        landing = target if target is not None else torch.empty(buffer.numel, dtype=getattr(torch, buffer.key.dtype))
        with self._lock:
            self._drain()
            seq, posted, payload = self._request(OP_READ, buffer.key.id, buffer.numel, landing=landing.view(-1))
            self._status(seq, posted, f"read of {buffer.key.name!r}")
            self._call(payload.wait, f"reading {buffer.key.name!r}")
        if target is None:
            out.copy_(landing.view_as(out))
        return out

    def write(self, buffer: Buffer, src: torch.Tensor) -> None:
        payload = src.detach().reshape(-1).to("cpu", getattr(torch, buffer.key.dtype)).contiguous()
        with self._lock:
            self._drain()
            seq, posted, _ = self._request(OP_WRITE, buffer.key.id, buffer.numel)
            # the payload right behind the header: the server posts its receive before the
            # status, and receives (then drops) the payload of a write it refuses
            sent = self._call(lambda: self.pg.send([payload], 0, _tag(seq, _PAYLOAD_IN)), "sending a payload")
            try:
                self._status(seq, posted, f"write of {buffer.key.name!r}")
            except (PermissionError, ValueError):
                if int(posted[1][2]):  # the server received (and dropped) the payload
                    self._call(sent.wait, f"writing {buffer.key.name!r}")
                raise
            self._call(sent.wait, f"writing {buffer.key.name!r}")

    def accumulate(self, src: Buffer, dst: Buffer) -> Ticket:
        if src.numel != dst.numel or src.key.dtype != dst.key.dtype:
            raise ValueError(f"cannot accumulate {src} into {dst}: sizes or dtypes differ")
        with self._lock:
            seq, (work, reply), _ = self._request(OP_ACCUMULATE, src.key.id, dst.key.id)
            ticket = Ticket(self.rank, seq)
            self._pending.append((ticket, work, reply))
        return ticket

    def done(self, ticket: Ticket) -> bool:
        with self._lock:
            while self._pending and self._pending[0][1].is_completed():
                self._drain_one()
            return self._done >= ticket.seq

    def _drain_one(self) -> None:
        ticket, work, reply = self._pending.pop(0)
        self._call(work.wait, f"waiting for accumulate #{ticket.seq}")
        self._check(reply, ticket.seq, f"accumulate #{ticket.seq}")
        self._done = ticket.seq

    def wait(self, ticket: Ticket, timeout: float | None = None) -> None:
        with self._lock:
            while self._done < ticket.seq and self._pending:
                self._drain_one()

    def close(self) -> None:
        """Say goodbye (after the accumulates in flight); the server stops when all have."""
        with self._lock:
            try:
                self._drain()
                self._call(lambda: self.pg.send([torch.ones(1, dtype=torch.uint8)], 0, TAG_LIVENESS).wait(),
                           "saying goodbye")  # leaving, not lost
                seq, posted, _ = self._request(OP_BYE)
                self._status(seq, posted, "goodbye")
            except (PeerFailure, PermissionError, ValueError):
                pass


def route_address(peer: str) -> str:
    """This host's address on the interface that routes to ``peer`` (loopback for a
    loopback peer): what a server here is reached at, and what a client binds."""
    return "127.0.0.1" if is_loopback(peer) else route_source(peer)


def start_memory_server(store: dist.Store, rank: int, world: int, *, timeout: float,
                        log: str | None = None) -> tuple[str, bytes]:
    """Start the job's memory server next to global rank 0 (collective; ``torchrun
    --nnodes N ... --strategy seasgd`` needs nothing else); returns its address and the
    secret every client proves (generated here, handed out through the job's store: the
    same trust as the rendezvous itself).

    The server runs in its own session, so it outlives the loss of rank 0; it ends when
    every client has said goodbye, or after ``timeout`` seconds without any request (a
    job whose workers are all gone), writing its log to ``log`` (removed when it ended
    cleanly).
    """
    import json
    import subprocess
    import sys
    import tempfile

    if rank == 0:
        bind = route_address(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        secret = secrets.token_hex(32)
        log = log or os.path.join(tempfile.gettempdir(), f"shmtrain-smb-{os.getpid()}.log")
        with open(log, "ab") as sink:
            proc = subprocess.Popen(
                [sys.executable, "-m", "shmtrain", "smb-server", "--clients", str(world), "--bind", bind,
                 "--port", "0", "--timeout", str(timeout), "--idle-exit", str(timeout), "--address-file", log + ".addr",
                 "--log-file", log],
                env={**os.environ, SECRET_ENV: secret}, stdin=subprocess.DEVNULL, stdout=sink, stderr=sink,
                start_new_session=True)
        deadline = time.monotonic() + timeout
        while not os.path.exists(log + ".addr"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise PeerFailure(f"the memory server did not start (exit status {proc.poll()}); see {log}")
            time.sleep(0.05)
        address = Path(log + ".addr").read_text().strip()
        os.unlink(log + ".addr")
        store.set("smb/auto", json.dumps({"address": address, "secret": secret, "log": log}))
    info = json.loads(store.get("smb/auto"))
    return info["address"], info["secret"].encode()
