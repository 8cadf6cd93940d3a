"""SMB-REMOTE's wire format: what the memory server and its clients send each other.

Transport: gloo point-to-point on one two-member process group per client connection
(the server is rank 0 of each, the client rank 1: :mod:`~shmtrain.fabric.smb.links`), over
a TCP store the server hosts, so a client can leave and connect again. torch RPC
(TensorPipe) was measured on the same loopback link and moved 4 MiB in 4-6.5 ms where
gloo's send/recv took 2.4 ms, so gloo it is (docs/async.md, "The remote buffer service").

Protocol: every request is one header (``int64[8]``: op, sequence number, arguments)
on tag ``REQUEST``; the server answers every header with a status reply (``int64[6]``)
on tag ``REPLY`` *before* any payload moves, so a refused or malformed request never
leaves bytes in flight: ``write`` sends its payload after an OK, ``read`` receives the
buffer after an OK, ``accumulate`` is answered when applied (the update notification of
Fig. 5). A client's requests are served in the order it sent them.

Names: ``create`` and ``lookup`` are requests too (the name follows the header as a
payload), so the server alone gives out buffer ids and names, and only to clients that
proved the secret; nothing about a buffer is read from the store.

Security: a client and the server prove the shared secret to each other once per
connection (:mod:`~shmtrain.fabric.smb.handshake`: fresh nonces on both sides, proofs
bound to the connection and the direction); ``SHMTRAIN_SECRET`` holds the secret where
no file does. What still goes through the store (progress, state and liveness marks) is
sealed with the same secret and the server's identity, its nonce (:func:`seal`,
:func:`unseal`): an entry written without the secret is refused by every reader.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import time

import torch.distributed as dist

from shmtrain.fabric.job.netif import route_source

HEADER, REPLY_WORDS = 8, 6
TAG_REQUEST, TAG_TO_SERVER = 1, 3
REPLY, TO_CLIENT, PAYLOAD_IN, VERDICT = 0, 1, 2, 3


def tag(seq: int, kind: int) -> int:
    """The tag of request ``seq``'s reply, payload to the client, or payload to the server:
    one per request, so a client posts its receives before it sends the header (no
    round trip waits for a receive to be posted) and a receive left posted after a
    refusal can never take a later message."""
    return 16 + ((seq % (1 << 22)) << 2) + kind


OP_HELLO, OP_READ, OP_WRITE, OP_ACCUMULATE, OP_BYE, OP_CREATE, OP_LOOKUP = 1, 2, 3, 4, 5, 6, 7
#: the compressed exchange of a client on another host (:mod:`~shmtrain.fabric.smb.compressed`)
OP_CREAD, OP_CACCUMULATE = 8, 9
#: what the server's log calls each op
OP_NAMES = {OP_HELLO: "hello", OP_READ: "read", OP_WRITE: "write", OP_ACCUMULATE: "accumulate",
            OP_BYE: "goodbye", OP_CREATE: "create", OP_LOOKUP: "lookup", OP_CREAD: "compressed read",
            OP_CACCUMULATE: "compressed accumulate"}
OK, REFUSED, BAD_REQUEST, NOT_FOUND, TAKEN = 0, 1, 2, 3, 4
STATUS = {REFUSED: "refused: this client has not proven the shared secret (give it the server's secret: "
                     "--secret-file FILE or SHMTRAIN_SECRET)",
           BAD_REQUEST: "malformed request", NOT_FOUND: "no such buffer name", TAKEN: "the name is already taken"}
#: a buffer name's longest UTF-8 form (create and lookup send it after the header)
NAME_BYTES = 512
#: the element types a buffer may have, by their code on the wire
DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8")
SECRET_ENV = "SHMTRAIN_SECRET"
#: the prefix of a store entry's seal (the handshake's proofs have their own)
SEAL = "shmtrain-smb-seal/2"


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP or ``localhost``) is a loopback address."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def route_address(peer: str) -> str:
    """This host's address on the interface that routes to ``peer`` (loopback for a
    loopback peer): what a server here is reached at, and what a client binds."""
    return "127.0.0.1" if is_loopback(peer) else route_source(peer)


def seal(secret: bytes | None, nonce: str, key: str, value: str) -> str:
    """``value`` for store entry ``key`` with the time it was written and, when there is a
    secret, HMAC-SHA256 over :data:`SEAL`, the server's nonce, the key, the value and that
    time (so an entry cannot be forged, moved to another key or carried over from another
    server)."""
    stamp = str(time.time_ns())
    mac = "" if secret is None else _seal_tag(secret, nonce, key, value, stamp)
    return f"{value};{stamp};{mac}"


def _seal_tag(secret: bytes, nonce: str, key: str, value: str, stamp: str) -> str:
    # its own prefix: no seal is ever a handshake's proof, nor one a proof
    return hmac.new(secret, f"{SEAL}\n{nonce}\n{key}\n{value}\n{stamp}".encode(), hashlib.sha256).hexdigest()


def unseal(secret: bytes | None, nonce: str, key: str, text: str) -> tuple[str, int] | None:
    """The value and write time of an entry written by :func:`seal`; None when it is malformed or,
    with a secret, not sealed with it (written by a party that has not proven it)."""
    value, _, rest = text.rpartition(";")
    value, _, stamp = value.rpartition(";")
    if not stamp.isdigit():
        return None
    if secret is not None:
        expected = _seal_tag(secret, nonce, key, value, stamp)
        if not hmac.compare_digest(rest.encode(), expected.encode()):
            return None
    return value, int(stamp)


def gloo_link(store: dist.Store, rank: int, size: int, host: str, timeout: datetime.timedelta) -> dist.ProcessGroup:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(dist.PrefixStore("smb/pg/", store), rank, size, options)
