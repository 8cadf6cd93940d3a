"""SMB-REMOTE's client: the buffer service for workers on other hosts (ShmCaffe III-B, Figs. 2, 5, 7).

:class:`RemoteBufferService` reaches a :class:`~shmtrain.fabric.smb.server.MemoryServer`
behind the same :class:`~shmtrain.fabric.smb.api.BufferService` interface as the local
shared-memory service, so no strategy changes to use it; it and the server prove the
shared secret to each other on connecting (:mod:`~shmtrain.fabric.smb.handshake`); its
board is a :class:`~shmtrain.fabric.smb.board.StoreProgressBoard` in the server's store
(sealed with the shared secret); buffer names go over the authenticated link
(``create``, ``lookup``). :func:`read_secret` finds the shared secret a client proves
(and a server asks for); :mod:`~shmtrain.fabric.smb.job_server` starts a job's own
memory server when the job was given none.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from shmtrain.fabric.shm.control import PeerFailure, PeerTimeout, first_line
from shmtrain.fabric.smb import handshake
from shmtrain.fabric.smb.api import STATE_DONE, Buffer, BufferKey, BufferService, Ticket
from shmtrain.fabric.smb.board import DEAD, LEFT, StoreProgressBoard
from shmtrain.fabric.smb.job_server import forget
from shmtrain.fabric.smb.links import join
from shmtrain.fabric.smb.stuck import CallWatch
from shmtrain.fabric.smb.wire import (
    DTYPES,
    NAME_BYTES,
    NOT_FOUND,
    OK,
    OP_ACCUMULATE,
    OP_BYE,
    OP_CREATE,
    OP_HELLO,
    OP_LOOKUP,
    OP_READ,
    OP_WRITE,
    PAYLOAD_IN,
    REFUSED,
    REPLY,
    REPLY_WORDS,
    SECRET_ENV,
    STATUS,
    TAG_REQUEST,
    TAG_TO_SERVER,
    TAKEN,
    TO_CLIENT,
    VERDICT,
    route_address,
    tag,
    unseal,
)


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
                 timeout: float = 120.0, job_server: bool = False) -> None:
        #: the job's own server (started next to global rank 0): it keeps no snapshot
        self.job_server = job_server
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
        #: every later store call is timed (a stopped server would hold it forever: ``stuck.py``)
        self.watch = CallWatch(address, timeout)
        clients = int(self.store.get("smb/clients"))
        if clients < world:
            raise ValueError(f"the memory server at {address} serves at most {clients} workers but this job has "
                             f"{world}; restart it with --clients {world}")
        self.lock = threading.Lock()
        self._seq = 0
        self._pending: list[tuple[Ticket, dist.Work, torch.Tensor]] = []
        self._done = 0
        self._await_earlier_lost(secret)
        self.store.set(f"smb/peer/{rank}", route_address(host))  # what the server's log names this client by
        self.store.add("smb/joined", 1)
        self._abandoned = False  # a server that failed the handshake: no goodbye waited for
        self.connection, self.pg = self.call(lambda: join(self.store, rank, world, route_address(host), delta),
                                              "connecting")
        nonce = self.store.get("smb/nonce").decode()  # the server's identity: checked by the handshake
        sealed = self.store.get("smb/secret") == b"1"
        try:
            if sealed and secret is None:
                raise PermissionError(f"the memory server at {address} requires a shared secret: pass "
                                      f"--secret-file FILE or set {SECRET_ENV}")
            if secret is not None and not sealed:
                raise PermissionError(
                    f"worker {rank} refused the memory server at {address}: it asks for no shared secret, but this "
                    f"worker was given one (--secret-file or {SECRET_ENV}), so it cannot prove it is the server "
                    "that secret belongs to; start the server with that secret, or give the workers none")
            if secret is not None:
                self._hello(secret, nonce)
        except PermissionError:
            self.close()  # leave, so the server does not wait for this client
            raise
        self.board = StoreProgressBoard(self.store, rank, world, self._lost, watch=self.watch,
                                        secret=secret if sealed else None, nonce=nonce)

    def _await_earlier_lost(self, secret: bytes | None) -> None:
        """A rank coming back (its host lost and started again) connects
        once the server has seen its earlier connection lost (the server serves one
        connection per rank); one whose earlier process still trains is refused, named."""
        nonce = self.store.get("smb/nonce").decode()
        key = secret if self.store.get("smb/secret") == b"1" else None

        def entry(name: str) -> str | None:
            raw = self.store.get(name) if self.store.check([name]) else b""
            opened = unseal(key, nonce, name, raw.decode(errors="replace")) if raw else None
            return None if opened is None else opened[0]

        progress = entry(f"smb/progress/{self.rank}")
        if progress is None or int(progress.split(",")[1]) == STATE_DONE:  # new, or it finished
            return
        deadline = time.monotonic() + self.timeout
        while entry(f"smb/dead/{self.rank}") not in (DEAD, LEFT):
            if time.monotonic() > deadline:
                raise PeerFailure(
                    f"rank {self.rank} is still connected to the memory server at {self.address} (its earlier "
                    f"process was not seen lost within {self.timeout:.0f} s): the server serves one connection "
                    "per rank; end every process of this host's earlier start (its torchrun agent and "
                    "workers), then start the host again")
            time.sleep(0.1)

    # -- requests --------------------------------------------------------------------
    def call(self, fn: Callable, what: str):
        try:
            with self.watch.call(what):
                return fn()
        except RuntimeError as exc:
            raise self._lost(exc, what) from None

    def _lost(self, exc: RuntimeError, what: str) -> Exception:
        """The error for a failed transfer to or from the server, naming it."""
        text = str(exc)
        if any(s in text for s in ("Connection closed", "Connection reset", "Broken pipe", "Connection refused",
                                   "Connection was likely closed")):  # the last: the store's words
            if self.job_server:
                return PeerFailure(f"the job's memory server at {self.address} (started next to global rank 0) "
                                   f"was lost (its connection closed: it died or was stopped) while {what}; it "
                                   "keeps no snapshot, so the job ends here: continue it from its latest "
                                   "checkpoint (shmtrain train --resume RUN_DIR, under torchrun as well), or run "
                                   "a `shmtrain smb-server --snapshot-every S` of your own and pass --smb-server")
            return PeerFailure(f"the memory server at {self.address} was lost (its connection closed: it died "
                               f"or was stopped) while {what}; restart it on the same address, with --resume from "
                               "its snapshot if it wrote one, then continue the job with shmtrain train --resume "
                               "RUN_DIR")
        if "Timed out" in text or "timed out" in text:
            return PeerTimeout(f"the memory server at {self.address} did not answer within "
                               f"{self.timeout:.0f} s while {what}", server=self.address)
        return PeerFailure(f"the memory server at {self.address} failed while {what}: {first_line(exc)}")

    def request(self, op: int, a: int = 0, b: int = 0, c: int = 0, landing: torch.Tensor | None = None,
                 d: int = 0) -> tuple[int, tuple[dist.Work, torch.Tensor], dist.Work | None]:
        """Post the receive of the reply (and of a read's payload into ``landing``), then
        send one header; returns the sequence number, the reply's (work, tensor) and the
        payload's work (the caller holds the lock)."""
        self._seq += 1
        seq = self._seq
        reply = torch.zeros(REPLY_WORDS, dtype=torch.int64)
        posted = (self.call(lambda: self.pg.recv([reply], 0, tag(seq, REPLY)), "posting a receive"), reply)
        payload = None
        if landing is not None:
            payload = self.call(lambda: self.pg.recv([landing], 0, tag(seq, TO_CLIENT)), "posting a receive")
        header = torch.tensor([op, seq, a, b, c, d, 0, 0], dtype=torch.int64)
        self.call(lambda: self.pg.send([header], 0, TAG_REQUEST).wait(), f"sending request #{seq}")
        return seq, posted, payload

    def status(self, seq: int, posted: tuple[dist.Work, torch.Tensor], what: str) -> torch.Tensor:
        work, reply = posted
        self.call(work.wait, f"waiting for the answer to {what}")
        self._check(reply, seq, what)
        return reply

    def _check(self, reply: torch.Tensor, seq: int, what: str) -> None:
        status, echoed = int(reply[0]), int(reply[1])
        if echoed != seq:
            raise PeerFailure(f"the memory server at {self.address} answered request #{echoed} "
                              f"while this worker expected #{seq} ({what})")
        if status == REFUSED:
            raise PermissionError(f"the memory server at {self.address} refused {what}: {STATUS[REFUSED]}")
        if status != OK:
            raise ValueError(f"the memory server at {self.address} rejected {what}: "
                             f"{STATUS.get(status, f'status {status}')} (see the server's log)")

    def drain(self) -> None:
        """Collect the answers of accumulates in flight (before any other answer)."""
        while self._pending:
            self._drain_one()

    def _hello(self, secret: bytes, nonce: str) -> None:
        """The client's side of the handshake (:mod:`~shmtrain.fabric.smb.handshake`) on
        this connection: its fresh nonce, the server's challenge and proof (checked first:
        a server that does not hold the secret is refused), then this client's proof."""
        mine = handshake.fresh()
        challenge = torch.zeros(2 * handshake.SIZE, dtype=torch.uint8)
        with self.lock:
            seq, posted, received = self.request(OP_HELLO, landing=challenge)
            sent = self.call(lambda: self.pg.send([torch.frombuffer(bytearray(mine), dtype=torch.uint8)], 0,
                                                   tag(seq, PAYLOAD_IN)), "sending the greeting")
            self.status(seq, posted, "the greeting")
            self.call(received.wait, "receiving the server's proof of the shared secret")
            self.call(sent.wait, "sending the greeting")
            data = bytes(challenge.tolist())
            ns, theirs = data[:handshake.SIZE], data[handshake.SIZE:]
            expected = handshake.proof(secret, handshake.SERVER, nonce, self.connection, self.rank, ns, mine)
            trusted = handshake.matches(theirs, expected)
            proof = (handshake.proof(secret, handshake.CLIENT, nonce, self.connection, self.rank, ns, mine)
                     if trusted else bytes(handshake.SIZE))  # zeros: never a proof, to a server that is not trusted
            second = torch.zeros(REPLY_WORDS, dtype=torch.int64)
            verdict = (self.call(lambda: self.pg.recv([second], 0, tag(seq, VERDICT)),
                                  "posting a receive"), second)
            self.call(lambda: self.pg.send([torch.frombuffer(bytearray(proof), dtype=torch.uint8)], 0,
                                            TAG_TO_SERVER).wait(), "proving the secret")
            if not trusted:
                try:  # a real server with another secret answers at once; a fake one may never
                    verdict[0].wait(datetime.timedelta(seconds=10))
                except RuntimeError:
                    self._abandoned = True
                raise PermissionError(
                    f"worker {self.rank} refused the memory server at {self.address}: its proof of the shared secret "
                    "is wrong, so it does not hold this worker's secret (a server started with another secret, or "
                    "someone else's server at that address); nothing was sent to it; give the server and every "
                    "worker the same secret, and check --smb-server")
            self.status(seq, verdict, "the proof of the shared secret")

    # -- the SMB API -----------------------------------------------------------------
    def _by_name(self, op: int, name: str, numel: int = 0, code: int = 0) -> torch.Tensor:
        """Send a create or lookup of ``name`` (the name right behind the header); returns
        the server's reply (status ``NOT_FOUND`` and ``TAKEN`` are the caller's to read)."""
        data = name.encode()
        if not 0 < len(data) <= NAME_BYTES:
            raise ValueError(f"buffer name {name!r}: {len(data)} bytes of UTF-8; a name takes 1 to {NAME_BYTES}")
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        what = f"{'create' if op == OP_CREATE else 'lookup'} of {name!r}"
        with self.lock:
            self.drain()
            seq, (work, reply), _ = self.request(op, numel, code, len(data))
            sent = self.call(lambda: self.pg.send([payload], 0, tag(seq, PAYLOAD_IN)), "sending a name")
            self.call(work.wait, f"waiting for the answer to the {what}")
            self.call(sent.wait, f"sending the name of the {what}")  # the server always receives it
        if int(reply[0]) not in (NOT_FOUND, TAKEN):
            self._check(reply, seq, what)
        return reply

    def create(self, name: str, numel: int, dtype: torch.dtype = torch.float32) -> BufferKey:
        if numel <= 0:
            raise ValueError(f"buffer {name!r}: numel must be positive, got {numel}")
        kind = str(dtype).removeprefix("torch.")
        if kind not in DTYPES:
            raise ValueError(f"buffer {name!r}: dtype {kind} cannot live on a memory server; use one of "
                             f"{', '.join(DTYPES)}")
        reply = self._by_name(OP_CREATE, name, numel, DTYPES.index(kind))
        if int(reply[0]) == TAKEN:
            raise ValueError(f"buffer name {name!r} is already taken on the memory server at {self.address}")
        buffer_id = int(reply[2])
        return BufferKey(name, buffer_id, numel, kind, f"{self.address}/{buffer_id}")

    def lookup(self, name: str) -> BufferKey:
        deadline = time.monotonic() + self.timeout
        delay = 0.001
        while int((reply := self._by_name(OP_LOOKUP, name))[0]) == NOT_FOUND:
            if time.monotonic() > deadline:
                raise PeerTimeout(f"no worker created SMB buffer {name!r} on {self.address} "
                                  f"within {self.timeout:.0f} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        buffer_id = int(reply[2])
        return BufferKey(name, buffer_id, int(reply[3]), DTYPES[int(reply[4])], f"{self.address}/{buffer_id}")

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
        with self.lock:
            self.drain()
            seq, posted, payload = self.request(OP_READ, buffer.key.id, buffer.numel, landing=landing.view(-1))
            self.status(seq, posted, f"read of {buffer.key.name!r}")
            self.call(payload.wait, f"reading {buffer.key.name!r}")
        if target is None:
            out.copy_(landing.view_as(out))
        return out

    def write(self, buffer: Buffer, src: torch.Tensor) -> None:
        payload = src.detach().reshape(-1).to("cpu", getattr(torch, buffer.key.dtype)).contiguous()
        with self.lock:
            self.drain()
            seq, posted, _ = self.request(OP_WRITE, buffer.key.id, buffer.numel)
            # the payload right behind the header: the server posts its receive before the
            # status, and receives (then drops) the payload of a write it refuses
            sent = self.call(lambda: self.pg.send([payload], 0, tag(seq, PAYLOAD_IN)), "sending a payload")
            try:
                self.status(seq, posted, f"write of {buffer.key.name!r}")
            except (PermissionError, ValueError):
                if int(posted[1][2]):  # the server received (and dropped) the payload
                    self.call(sent.wait, f"writing {buffer.key.name!r}")
                raise
            self.call(sent.wait, f"writing {buffer.key.name!r}")

    def accumulate(self, src: Buffer, dst: Buffer) -> Ticket:
        if src.numel != dst.numel or src.key.dtype != dst.key.dtype:
            raise ValueError(f"cannot accumulate {src} into {dst}: sizes or dtypes differ")
        with self.lock:
            seq, (work, reply), _ = self.request(OP_ACCUMULATE, src.key.id, dst.key.id)
            ticket = Ticket(self.rank, seq)
            self._pending.append((ticket, work, reply))
        return ticket

    def done(self, ticket: Ticket) -> bool:
        with self.lock:
            while self._pending and self._pending[0][1].is_completed():
                self._drain_one()
            return self._done >= ticket.seq

    def _drain_one(self) -> None:
        ticket, work, reply = self._pending.pop(0)
        self.call(work.wait, f"waiting for accumulate #{ticket.seq}")
        self._check(reply, ticket.seq, f"accumulate #{ticket.seq}")
        self._done = ticket.seq

    def wait(self, ticket: Ticket, timeout: float | None = None) -> None:
        with self.lock:
            while self._done < ticket.seq and self._pending:
                self._drain_one()

    def close(self) -> None:
        """Say goodbye (after the accumulates in flight); the server stops when all have."""
        forget(self.address)  # the secret this worker kept for its host's next start, if any
        if self._abandoned:
            self.watch.close()
            return
        with self.lock:
            try:
                self.drain()
                seq, posted, _ = self.request(OP_BYE)
                self.status(seq, posted, "goodbye")
            except (PeerFailure, PermissionError, ValueError):
                pass
            finally:
                self.watch.close()
