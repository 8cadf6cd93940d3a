"""SMB-REMOTE's gate: who a client is, its proof of the secret, and what only proven clients get.

The part of :class:`~shmtrain.fabric.smb.server.MemoryServer` that decides trust (ShmCaffe
III-B's memory server, with the security a server on a network needs): a client proves
the shared secret (HMAC-SHA256 of the server's nonce) before anything else; buffer names
and ids are given out by the server alone, on the authenticated link, so no party can
create a buffer or re-point a name through the store; :meth:`Gate.audit` logs every
store entry a party without the secret wrote (the store authenticates no one). Every
refusal is one log line naming the client (job rank, announced address) and the
operation.
"""

from __future__ import annotations

import datetime
import hmac
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from shmtrain.fabric.smb.api import BufferKey
from shmtrain.fabric.smb.board import StoreAudit
from shmtrain.fabric.smb.wire import (
    _PAYLOAD_IN,
    _VERDICT,
    DTYPES,
    NAME_BYTES,
    NOT_FOUND,
    OK,
    OP_LOOKUP,
    REFUSED,
    TAG_TO_SERVER,
    TAKEN,
    _proof,
    _tag,
)


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

    def _open_gate(self) -> None:
        self.keys: dict[int, BufferKey] = {}  # by id; given out by this server only
        self.names: dict[str, int] = {}
        self._audit = StoreAudit(self.store, self.secret, self.nonce, self._own, self.clients)
        self._last_audit = 0.0

    address: str

    def _reply(self, client: int, status: int, seq: int, value: int = 0, kind: int = 0,
               extra: tuple[int, int] = (0, 0)) -> None:
        raise NotImplementedError

    def _bad(self, client: int, seq: int, why: str, drained: bool = False) -> None:
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
        proof = torch.zeros(32, dtype=torch.uint8)
        self._reply(client, OK, seq)  # then the proof
        self._links[client].recv([proof], 1, TAG_TO_SERVER).wait(min(self._bound, datetime.timedelta(seconds=10)))
        expected = _proof(self.secret, self.nonce) if self.secret else proof
        if hmac.compare_digest(bytes(proof.tolist()), bytes(expected.tolist())):
            self._trusted.add(client)
            self._reply(client, OK, seq, kind=_VERDICT)
        else:
            self.refused += 1
            self.log(f"shmtrain smb-server: {self._who(client)} refused: its proof of the shared secret is wrong")
            self._reply(client, REFUSED, seq, kind=_VERDICT)

    def _name(self, client: int, seq: int, length: int) -> str | None:
        """The buffer name that follows a create or lookup header (None: a length out of
        range, whose payload is not received: the client abandons it on the error)."""
        if not 0 < length <= NAME_BYTES:
            return None
        data = torch.zeros(length, dtype=torch.uint8)
        self._links[client].recv([data], 1, _tag(seq, _PAYLOAD_IN)).wait(
            min(self._bound, datetime.timedelta(seconds=10))
        )
        return bytes(data.tolist()).decode(errors="replace")

    def _named(self, client: int, op: int, seq: int, name: str, numel: int, code: int) -> None:
        """Create buffer ``name`` (zero-filled; this server gives out its id) or look it up."""
        known = self.names.get(name)
        if op == OP_LOOKUP:
            if known is None:
                return self._reply(client, NOT_FOUND, seq)
            key = self.keys[known]
            return self._reply(client, OK, seq, known, extra=(key.numel, DTYPES.index(key.dtype)))
        if known is not None:
            self.log(f"shmtrain smb-server: {self._who(client)}: create of {name!r}: the name is already taken")
            return self._reply(client, TAKEN, seq)
        if not 0 < numel < 1 << 40 or not 0 <= code < len(DTYPES):
            return self._bad(client, seq, f"create of {name!r} with {numel} elements of type code {code}")
        buffer_id = max(self.keys, default=-1) + 1
        with self._lock:
            self.keys[buffer_id] = BufferKey(name, buffer_id, numel, DTYPES[code], f"{self.address}/{buffer_id}")
            self.buffers[buffer_id] = torch.zeros(numel, dtype=getattr(torch, DTYPES[code]))
            self.names[name] = buffer_id
        self._reply(client, OK, seq, buffer_id)
