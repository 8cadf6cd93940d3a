"""SMB-REMOTE's wire format: what the memory server and its clients send each other.

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

Security: a client proves the shared secret with HMAC-SHA256 of a nonce the server
publishes (:func:`_proof`); ``SHMTRAIN_SECRET`` holds the secret where no file does.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress

import torch
import torch.distributed as dist

from shmtrain.fabric.netif import route_source

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


def _proof(secret: bytes, nonce: str) -> torch.Tensor:
    digest = hmac.new(secret, nonce.encode(), hashlib.sha256).digest()
    return torch.frombuffer(bytearray(digest), dtype=torch.uint8)


def _gloo(store: dist.Store, rank: int, size: int, host: str, timeout: datetime.timedelta) -> dist.ProcessGroup:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(dist.PrefixStore("smb/pg/", store), rank, size, options)
