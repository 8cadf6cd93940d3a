"""SMB-REMOTE's memory server: the process that owns the global buffers (ShmCaffe III-B, Figs. 5, 7).

ShmCaffe's workers on many nodes reach one *remote* memory server that owns the global buffers and
applies every accumulation itself, one request at a time (Fig. 5). :class:`MemoryServer` is that
process; its clients :class:`~shmtrain.fabric.smb.remote.RemoteBufferService`, its messages
:mod:`~shmtrain.fabric.smb.wire`'s (compressed ones :mod:`~shmtrain.fabric.smb.compressed`'s).
Security (docs/async.md, "Security"; docs/security.md): the store and the links listen on the bind
address alone (:func:`~shmtrain.fabric.trust.bound_store`); a non-loopback bind needs a shared secret,
which client and server prove to each other on each connection (:mod:`~shmtrain.fabric.smb.handshake`);
a client that has not is refused with one logged line and nothing changes. Buffer names and ids are
given out on the authenticated link only; :class:`~shmtrain.fabric.smb.board.StoreAudit` logs every
store entry a party without the secret wrote."""

from __future__ import annotations

import datetime
import queue
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from shmtrain.fabric.shm.control import PeerTimeout, first_line
from shmtrain.fabric.smb.board import ALIVE, DEAD, LEFT
from shmtrain.fabric.smb.compressed import COMPRESSED_OPS, serve_compressed
from shmtrain.fabric.smb.gate import Gate
from shmtrain.fabric.smb.links import Acceptor, receive_requests
from shmtrain.fabric.smb.snapshot import read_snapshot, write_snapshot
from shmtrain.fabric.smb.wire import (
    BAD_REQUEST,
    NAME_BYTES,
    OK,
    OP_ACCUMULATE,
    OP_BYE,
    OP_CREATE,
    OP_HELLO,
    OP_LOOKUP,
    OP_NAMES,
    OP_READ,
    OP_WRITE,
    PAYLOAD_IN,
    REFUSED,
    REPLY,
    SECRET_ENV,
    TO_CLIENT,
    is_loopback,
    seal,
    tag,
)
from shmtrain.fabric.trust import bound_store


class MemoryServer(Gate):
    """The memory server: owns the global buffers, applies requests one at a time.

    Args:
        clients: the job's workers at most (ranks 0 to ``clients - 1``; they come and go).
        bind: address to listen on (loopback by default).
        port: port of the server's store (0: any free one; see :attr:`port`).
        secret: shared secret every client must prove; required for a non-loopback bind.
        timeout: seconds a connection, a payload or a reply may take.
        log: where reasons for refusals and errors go.
        resume: a snapshot file (:meth:`snapshot`) to start the buffers from (taken over by creates).
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
        self.store = bound_store(bind, port, timeout=timeout)  # not on every interface, as TCPStore's own
        self.port = self.store.port
        self.nonce = secrets.token_hex(16)
        self.buffers: dict[int, torch.Tensor] = {}
        self.applied = 0
        self.refused = 0
        self.errors = 0
        #: clients whose link closed before they said goodbye (rank -> when), also
        #: recorded as ``smb/dead/<rank>`` in the store for the other workers' boards
        self.lost: dict[int, float] = {}
        self.returned = 0  #: connections of lost clients that came back
        self._trusted: set[int] = set() if secret else set(range(1, clients + 1))
        self._left: set[int] = set()
        self.lock = threading.Lock()  # buffers: the serving loop vs snapshots
        self.last_request = time.monotonic()
        # per client: its payloads in flight, oldest first (kind, work, tensor, buffer id,
        # finished, failure): one, or two writes (the older one still being applied)
        self.inflight: dict[int, list[tuple]] = {}
        self._writes: dict[int, int] = {}  # per client: writes so far (their staging slot)
        self._state = threading.RLock()  # requests vs reap(): clients, transfers in flight
        self._copies: dict[tuple[int, int], torch.Tensor | None] = {}  # (client, slot) -> staging tensor
        self.links: dict[int, dist.ProcessGroup] = {}  # client -> its link (peer rank 1)
        self.generation: dict[int, int] = {}  # client -> the connection its link is
        self._receivers: dict[int, threading.Thread] = {}
        self._inbox: queue.Queue = queue.Queue()  # joins, requests and closed links, in order
        self._world = 1  # the job's workers, as its clients announce them (at most ``clients``)
        self._drops: list[threading.Thread] = []  # receives of refused writes' payloads
        self._sending: dict[int, int] = {}  # id(tensor) -> reads in flight from it
        self._own = {"smb/clients": str(clients), "smb/nonce": self.nonce, "smb/secret": "1" if secret else "0"}
        for key, value in self._own.items():
            self.store.set(key, value)
        self._open_gate()
        if resume:
            self._resume(resume)
        watch = dist.TCPStore("127.0.0.1" if bind in ("0.0.0.0", "::") else bind, self.port, None, False,
                              datetime.timedelta(seconds=timeout))
        self._acceptor = Acceptor(self.store, watch, bind, clients, self._inbox, self._admit, log)

    @property
    def address(self) -> str:
        return f"{self.bind}:{self.port}"

    @property
    def remaining(self) -> int:
        """Connected clients that have neither said goodbye nor been lost."""
        return len(self.links.keys() - self._left)

    @property
    def finished(self) -> bool:
        """Every worker of the job (as its clients announce it) came and left or was lost."""
        return bool(self.links) and len(self.links) >= self._world and not self.remaining

    # -- buffers ---------------------------------------------------------------------
    def snapshot(self, path: str | Path) -> None:
        """Write every buffer and its key to ``path`` atomically (temporary file, fsync, rename)."""
        with self.lock:
            buffers = {i: t.clone() for i, t in self.buffers.items()}
        write_snapshot(path, {i: self.keys[i] for i in buffers}, buffers, self.applied)

    def _resume(self, path: str) -> None:
        self.keys, self.buffers, self.applied = read_snapshot(path)
        self.names = {key.name: i for i, key in self.keys.items()}
        self.restored = set(self.names)

    # -- serving -----------------------------------------------------------------------
    def serve(self) -> None:
        """Accept clients as they come (a lost one may connect again) and serve them until
        every client that came has said goodbye or been lost."""
        self._acceptor.start()
        while not self.finished:
            try:
                event = self._inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            kind, client, generation, detail = event
            if kind == "joined":
                self._joined(client, generation, detail)
            elif generation != self.generation.get(client):  # from a link replaced since
                if kind == "request":
                    detail[1].set()
            elif kind == "closed":
                self._closed(client, detail)
            else:
                header, handled = detail
                try:
                    self._request(client, header)
                finally:
                    handled.set()
        self._acceptor.stop()
        self.reap()

    def _request(self, client: int, header: torch.Tensor) -> None:
        self.last_request = time.monotonic()
        with self._state:
            self._settle(block=False)  # payloads that have arrived, from anyone
            if client in self._left:
                return
            try:
                # its own earlier transfers come first; a write may follow a write still
                # being applied (its watcher applies them in order)
                self._settle_client(client, block=True, keep_write=int(header[0]) == OP_WRITE)
                self._handle(client, header)
            except RuntimeError as exc:
                self._lose(client, exc)

    def _admit(self, client: int) -> str | None:
        """Why a connection for ``client`` is refused (None: it is not; a rank whose link
        is up cannot be taken over: it must be lost or gone first)."""
        with self._state:
            if client in self.links and client not in self._left:
                return (f"rank {client - 1} is connected already; a rank has one connection at a time: end its "
                        "earlier process first (if none runs, someone else is using its rank)")
            return None

    def _joined(self, client: int, generation: int, detail: tuple[dist.ProcessGroup, int]) -> None:
        """A (new) link for ``client``: it starts untrusted, with nothing in flight; a lost
        client that comes back is marked alive again on the board."""
        link, world = detail
        with self._state:
            self._world = max(self._world, world)
            back = client - 1 in self.lost
            self.links[client], self.generation[client] = link, generation
            self._left.discard(client)
            self.inflight.pop(client, None)
            self._writes.pop(client, None)
            for slot in (0, 1):
                self._copies.pop((client, slot), None)
            if self.secret:
                self._trusted.discard(client)
            if back:
                del self.lost[client - 1]
                self.returned += 1
                self._mark(client, ALIVE)
        self.last_request = time.monotonic()
        if back:
            self.log(f"shmtrain smb-server: {self._who(client)} connected again (connection {generation}); "
                     "it reads the buffers as they are now")
        self._receivers[client] = thread = threading.Thread(target=receive_requests, name=f"smb-recv-{client}",
                                                            args=(link, client, generation, self._inbox), daemon=True)
        thread.start()

    def _closed(self, client: int, exc: BaseException) -> None:
        """``client``'s link closed: leaving after its goodbye, else lost. A lost client is
        marked ``smb/dead/<rank>`` so the survivors' boards (TERM) stop counting on it."""
        with self._state:
            if client in self._left:
                return
            if self.inflight.get(client):  # the same loss the transfer's watcher sees
                self._lose(client, exc)
                return
            self._left.add(client)
            self._record_lost(client)
        self.log(f"shmtrain smb-server: client {client - 1} lost (its link closed: {first_line(exc)}); "
                 "what it applied stays; serving the others")

    def connect(self, timeout: float | None = None) -> None:
        """Wait until every one of ``clients`` has connected (within ``timeout`` seconds,
        default the server's): for a caller that needs them all at once (the benchmark)."""
        self._acceptor.start()
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while len(self.links) < self.clients:
            try:
                event = self._inbox.get(timeout=max(0.0, min(0.2, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise PeerTimeout(f"only {len(self.links)} of {self.clients} clients connected to the memory "
                                      f"server at {self.address} within {self.timeout:.0f} s") from None
                continue
            if event[0] != "joined":
                raise RuntimeError(f"the memory server got {event[0]} before every client connected")
            self._joined(*event[1:])

    def link(self, client: int) -> dist.ProcessGroup:
        """Client ``client``'s link (its peer there is rank 1)."""
        return self.links[client]

    @property
    def watching(self) -> int:
        """Threads still waiting in gloo (the request receives of clients that neither said
        goodbye nor were lost, receives of dropped payloads): gloo aborts a process that
        exits while one waits, so the caller leaves with ``os._exit`` then."""
        return sum(t.is_alive() for t in [*self._receivers.values(), *self._drops]) + self._acceptor.busy

    def reap(self) -> None:
        """Apply the payloads that have arrived and drop the clients lost mid-transfer
        (called between requests, and by the server's main thread while it waits for one)."""
        with self._state:
            self._settle(block=False)
        self.audit()

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

    def track(self, client: int, kind: str, work: dist.Work, tensor: torch.Tensor, buffer_id: int,
               slot: tuple[int, int] | None = None) -> None:
        """Watch a payload in flight: gloo reports a transfer's end (or its peer's death)
        only to a waiter, so one short-lived thread waits for it. A write that has arrived
        whole becomes the buffer (its staging tensor and the old buffer trade places, no
        copy); ``slot`` is the staging slot the old buffer takes."""
        finished, failure = threading.Event(), []
        entries = self.inflight.setdefault(client, [])
        before = entries[-1] if entries else None  # a write still being applied

        def watch() -> None:
            try:
                work.wait()
                if kind == "write":  # every byte has arrived: apply it whole, off the request path
                    if before is not None:
                        before[4].wait()  # in the client's order
                    if before is None or not before[5]:
                        with self.lock:
                            old, self.buffers[buffer_id] = self.buffers[buffer_id], tensor
                            # a read still sending the old tensor keeps it out of the slots
                            self._copies[slot] = None if self._sending.get(id(old)) else old
            except RuntimeError as exc:
                failure.append(exc)
            finally:
                if kind == "read":
                    with self.lock:
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
        self.inflight.pop(client, None)
        self._record_lost(client)
        self.log(f"shmtrain smb-server: client {client - 1} lost in the middle of a request "
                 f"({first_line(exc)}); nothing of it was applied; serving the others")

    def _record_lost(self, client: int) -> None:
        self.lost[client - 1] = time.time()
        self._mark(client, DEAD)

    def _mark(self, client: int, value: str) -> None:
        """Client ``client``'s liveness mark on the board (sealed; a newer one wins)."""
        try:
            key = f"smb/dead/{client - 1}"
            self.store.set(key, seal(self.secret, self.nonce, key, value))
        except RuntimeError:  # the store is this process's own: only at shutdown
            pass

    def _settle(self, block: bool) -> None:
        for client in list(self.inflight):
            try:
                self._settle_client(client, block)
            except RuntimeError as exc:
                self._lose(client, exc)

    def _settle_client(self, client: int, block: bool, keep_write: bool = False) -> None:
        """Finish ``client``'s payloads in flight (``keep_write``: all but a last write): a
        write is applied only once every byte has arrived (into a staging copy), so a
        client lost mid-payload changes nothing."""
        entries = self.inflight.get(client)
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

    def reply(self, client: int, status: int, seq: int, value: int = 0, kind: int = REPLY,
               extra: tuple[int, int] = (0, 0)) -> None:
        self.links[client].send([torch.tensor([status, seq, value, *extra, 0], dtype=torch.int64)], 1,
                      tag(seq, kind)).wait(self._bound)

    def _handle(self, client: int, header: torch.Tensor) -> None:
        op, seq, a, b, c = (int(x) for x in header[:5])
        pg = self.links[client]
        if op == OP_HELLO:
            return self._hello(client, seq)
        name = self._name(client, seq, c) if op in (OP_CREATE, OP_LOOKUP) else None
        if op == OP_BYE:
            self._left.add(client)
            self._mark(client, LEFT)  # its rank may connect again (a rejoin) at once
            self.reply(client, OK, seq)
            return
        if client not in self._trusted:
            self.refused += 1
            what = OP_NAMES.get(op, f"op {op}") + (f" of {name!r}" if name is not None else f" (buffer {a})")
            self.log(f"shmtrain smb-server: {self._who(client)} refused {what}: it has not proven the shared secret; "
                     f"give it the server's secret (--secret-file FILE or {SECRET_ENV})")
            drained = (op == OP_WRITE and self._drop_payload(client, seq, a, b)) or name is not None
            self.reply(client, REFUSED, seq, int(drained))
            return
        if op in COMPRESSED_OPS:
            return serve_compressed(self, client, header)
        if op in (OP_CREATE, OP_LOOKUP):
            if name is None:
                return self.bad(client, seq, f"{OP_NAMES[op]} with a name of {c} bytes (1 to {NAME_BYTES})")
            return self._named(client, op, seq, name, a, b)
        if op in (OP_READ, OP_WRITE):
            with self.lock:  # a read counts as in flight from the buffer it takes, at once
                tensor = self.buffers.get(a)
                if tensor is not None and b == tensor.numel() and op == OP_READ:
                    self._sending[id(tensor)] = self._sending.get(id(tensor), 0) + 1
            if tensor is None or b != tensor.numel():
                drained = op == OP_WRITE and self._drop_payload(client, seq, a, b)
                return self.bad(client, seq, f"op {op} on buffer {a} with {b} elements: no such buffer", drained)
            # the payload moves while the server serves the others (a stalled client blocks
            # no one): a read is sent from the buffer itself, like the paper's RDMA read
            # (not atomic against an accumulate applied meanwhile, as with the local
            # service); a write lands in a staging copy applied whole once it has arrived,
            # whose receive is posted before the status, so the payload follows at once
            if op == OP_READ:
                self.reply(client, OK, seq)
                self.track(client, "read", pg.send([tensor], 1, tag(seq, TO_CLIENT)), tensor, a)
            else:
                slot, copy = self._copy(client, tensor)  # a slot whose last transfer was settled
                self.track(client, "write", pg.recv([copy], 1, tag(seq, PAYLOAD_IN)), copy, a, slot)
                self.reply(client, OK, seq)
            return
        if op == OP_ACCUMULATE:
            src, dst = self.buffers.get(a), self.buffers.get(b)
            if src is None or dst is None or src.numel() != dst.numel() or src.dtype != dst.dtype:
                return self.bad(client, seq, f"accumulate {a} into {b}: unknown buffers or sizes differ")
            with self.lock:  # the buffers as they are now (a write that arrived replaces one)
                self.buffers[b].add_(self.buffers[a])  # exclusive: the one serving thread applies it, once
                self.applied += 1
            self.reply(client, OK, seq, self.applied)
            return
        self.bad(client, seq, f"unknown op {op}")

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
        work = self.links[client].recv([torch.empty(numel, dtype=known.dtype)], 1, tag(seq, PAYLOAD_IN))

        def drop() -> None:
            try:
                work.wait()
            except RuntimeError:
                pass  # the client's link broke: its watcher reports it

        thread = threading.Thread(target=drop, name=f"smb-drop-{client}", daemon=True)
        self._drops.append(thread)
        thread.start()
        return True

    def bad(self, client: int, seq: int, why: str, drained: bool = False) -> None:
        self.errors += 1
        self.log(f"shmtrain smb-server: client {client - 1}: {why}; answered with an error")
        self.reply(client, BAD_REQUEST, seq, int(drained))

