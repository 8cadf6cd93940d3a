"""SMB-REMOTE's gate: who a client is, the handshake, and what only proven clients get.

The part of :class:`~shmtrain.fabric.smb.server.MemoryServer` that decides trust (ShmCaffe
III-B's memory server, with the security a server on a network needs): a client and
the server prove the shared secret to each other once per connection before anything
else (:mod:`~shmtrain.fabric.smb.handshake`: a fresh challenge per connection, proofs
bound to it and to their direction, a replayed proof refused); buffer names and ids are
given out by the server alone, on the authenticated link, so no party can create a
buffer or re-point a name through the store; :meth:`Gate.audit` logs every store entry
a party without the secret wrote (the store authenticates no one). Every refusal is one
log line naming the client (job rank, announced address), what was refused and the fix.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from shmtrain.fabric.smb import handshake
from shmtrain.fabric.smb.api import BufferKey
from shmtrain.fabric.smb.board import StoreAudit
from shmtrain.fabric.smb.wire import (
    BAD_REQUEST,
    DTYPES,
    NAME_BYTES,
    NOT_FOUND,
    OK,
    OP_LOOKUP,
    PAYLOAD_IN,
    REFUSED,
    SECRET_ENV,
    TAG_TO_SERVER,
    TAKEN,
    TO_CLIENT,
    VERDICT,
    tag,
)

#: how long the server waits for a client's nonce or proof (the serving thread waits)
HANDSHAKE_WAIT = datetime.timedelta(seconds=10)


class Gate:
    """The memory server's trust and names (a base of ``MemoryServer``, which provides the
    link, the store, the log and the replies)."""

    store: dist.TCPStore
    secret: bytes | None
    nonce: str
    clients: int
    refused: int
    log: Callable[[str], None]
    buffers: dict[int, torch.Tensor]
    _links: dict[int, dist.ProcessGroup]
    _bound: datetime.timedelta
    _lock: threading.Lock
    _trusted: set[int]
    _own: dict[str, str]
    _generation: dict[int, int]

    def _open_gate(self) -> None:
        self.keys: dict[int, BufferKey] = {}  # by id; given out by this server only
        self.names: dict[str, int] = {}
        #: names restored from a snapshot (``--resume``) that no create has taken over yet
        self.restored: set[str] = set()
        self._audit = StoreAudit(self.store, self.secret, self.nonce, self._own, self.clients)
        self._last_audit = 0.0
        self._proofs: dict[bytes, int] = {}  # every client proof received -> its connection

    address: str

    def reply(self, client: int, status: int, seq: int, value: int = 0, kind: int = 0,
               extra: tuple[int, int] = (0, 0)) -> None:
        raise NotImplementedError

    def bad(self, client: int, seq: int, why: str, drained: bool = False) -> None:
        raise NotImplementedError

    def audit(self, every: float = 0.5) -> None:
        """Log what parties without the secret wrote into the store (at most every ``every`` s)."""
        if time.monotonic() - self._last_audit < every:
            return
        self._last_audit = time.monotonic()
        try:
            lines = self._audit.run()
        except RuntimeError:  # the store is this process's own: only at shutdown
            return
        self.refused += len(lines)
        for line in lines:
            self.log(line)

    def _who(self, client: int) -> str:
        """Client ``client`` as the log names it: its job rank and the address it announced."""
        try:
            key = f"smb/peer/{client - 1}"
            address = self.store.get(key).decode(errors="replace")[:64] if self.store.check([key]) else "unknown"
        except RuntimeError:
            address = "unknown"
        return f"client {client - 1} (announced address {address})"

    def _hello(self, client: int, seq: int) -> None:
        """The server's side of the handshake (:mod:`~shmtrain.fabric.smb.handshake`): the
        client's nonce, then the server's challenge and proof, then the client's proof."""
        link, wait = self.links[client], min(self._bound, HANDSHAKE_WAIT)
        nonce = torch.zeros(handshake.SIZE, dtype=torch.uint8)
        link.recv([nonce], 1, tag(seq, PAYLOAD_IN)).wait(wait)
        if not self.secret:
            self.refused += 1
            self.log(f"shmtrain smb-server: {self._who(client)}: its greeting refused: this server has no shared "
                     f"secret to prove; start the server with --secret-file FILE (or {SECRET_ENV}), or give the "
                     "client none")
            return self.reply(client, BAD_REQUEST, seq)
        n, rank, nc = self.generation[client], client - 1, bytes(nonce.tolist())
        challenge = handshake.fresh()
        mine = handshake.proof(self.secret, handshake.SERVER, self.nonce, n, rank, challenge, nc)
        self.reply(client, OK, seq)  # then the challenge and this server's proof
        link.send([torch.frombuffer(bytearray(challenge + mine), dtype=torch.uint8)], 1,
                  tag(seq, TO_CLIENT)).wait(self._bound)
        got = torch.zeros(handshake.SIZE, dtype=torch.uint8)
        link.recv([got], 1, TAG_TO_SERVER).wait(wait)
        theirs = bytes(got.tolist())
        expected = handshake.proof(self.secret, handshake.CLIENT, self.nonce, n, rank, challenge, nc)
        earlier = self._proofs.get(theirs)
        if earlier is None and handshake.matches(theirs, expected):
            self._proofs[theirs] = n
            self._trusted.add(client)
            return self.reply(client, OK, seq, kind=VERDICT)
        self.refused += 1
        fix = f"give it the server's secret (--secret-file FILE or {SECRET_ENV}, the same on every host)"
        if earlier is not None:
            why = (f"its proof of the shared secret (connection {n}) is a replay of connection {earlier}'s, "
                   "captured from the network by a party without the secret; nothing it asks is served (the "
                   f"secret was not revealed); find who reaches {self.address}")
        elif not any(theirs):  # the client's answer when this server's proof was wrong
            why = (f"its proof of the shared secret is wrong: it found this server's proof wrong (connection {n}), "
                   f"so the two secrets differ; {fix}")
        else:
            why = f"its proof of the shared secret is wrong (connection {n}); {fix}"
        self.log(f"shmtrain smb-server: {self._who(client)} refused: {why}")
        self.reply(client, REFUSED, seq, kind=VERDICT)

    def _name(self, client: int, seq: int, length: int) -> str | None:
        """The buffer name that follows a create or lookup header (None: a length out of
        range, whose payload is not received: the client abandons it on the error)."""
        if not 0 < length <= NAME_BYTES:
            return None
        data = torch.zeros(length, dtype=torch.uint8)
        self.links[client].recv([data], 1, tag(seq, PAYLOAD_IN)).wait(
            min(self._bound, datetime.timedelta(seconds=10))
        )
        return bytes(data.tolist()).decode(errors="replace")

    def _named(self, client: int, op: int, seq: int, name: str, numel: int, code: int) -> None:
        """Create buffer ``name`` (zero-filled; this server gives out its id) or look it up."""
        known = self.names.get(name)
        if op == OP_LOOKUP:
            if known is None:
                return self.reply(client, NOT_FOUND, seq)
            key = self.keys[known]
            return self.reply(client, OK, seq, known, extra=(key.numel, DTYPES.index(key.dtype)))
        if known is not None and name in self.restored:
            key = self.keys[known]
            if key.numel == numel and 0 <= code < len(DTYPES) and key.dtype == DTYPES[code]:
                # a job started again after the server was: its first create of each name
                # takes over the buffer restored from the snapshot (its values kept; once)
                self.restored.discard(name)
                self.log(f"shmtrain smb-server: {self._who(client)}: create of {name!r} takes over the buffer "
                         "restored from the snapshot")
                return self.reply(client, OK, seq, known)
        if known is not None:
            self.log(f"shmtrain smb-server: {self._who(client)}: create of {name!r} refused: the name is already "
                     "taken (look it up instead)")
            return self.reply(client, TAKEN, seq)
        if not 0 < numel < 1 << 40 or not 0 <= code < len(DTYPES):
            return self.bad(client, seq, f"create of {name!r} with {numel} elements of type code {code}")
        buffer_id = max(self.keys, default=-1) + 1
        with self.lock:
            self.keys[buffer_id] = BufferKey(name, buffer_id, numel, DTYPES[code], f"{self.address}/{buffer_id}")
            self.buffers[buffer_id] = torch.zeros(numel, dtype=getattr(torch, DTYPES[code]))
            self.names[name] = buffer_id
        self.reply(client, OK, seq, buffer_id)
