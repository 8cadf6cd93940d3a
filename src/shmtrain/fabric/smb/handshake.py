"""SMB-REMOTE's handshake: how a client and the memory server prove the shared secret to each other.

ShmCaffe's memory server (Ahn et al., Section III-B, Fig. 7) serves workers on other
hosts over the network; this is the check a server on a network needs before it lets a
worker read or change the global buffers, and before a worker trusts what it reads.

Per connection (the link ``n`` a client formed, :mod:`~shmtrain.fabric.smb.links`):

1. the client sends a fresh random nonce ``Nc`` with its ``hello``;
2. the server draws a fresh random challenge ``Ns`` and answers with ``Ns`` and its
   proof ``HMAC(secret, "server", id, n, rank, Ns, Nc)``; the client checks it
   (:func:`hmac.compare_digest`), so a server that does not hold the secret (a fake one
   the client was pointed at) is detected before the client sends anything else;
3. the client answers with its proof ``HMAC(secret, "client", id, n, rank, Ns, Nc)``;
   the server checks it the same way, and refuses a proof it has seen before (a replay).

``id`` is the server's identity as the client read it from the store (``smb/nonce``),
``rank`` the client's job rank, ``n`` its connection: a proof is good for one
connection, one direction and one server, so a proof captured on the network proves
nothing later, and each side's proof covers the other's fresh nonce. The server's
identity is also the key of the store entries' seals (:func:`~shmtrain.fabric.smb.wire.seal`,
another message prefix): the handshake is what tells a client that the identity it seals
with is the server's.

What the handshake does not do: encrypt or authenticate the link after it (gloo sends
tensors in clear); someone who can alter the traffic between a client and the server
can relay a handshake and take the link over (docs/async.md, "Security").
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

#: the protocol's name in every proof (a proof of another protocol or version never matches)
PROTOCOL = b"shmtrain-smb-proof/2"
CLIENT, SERVER = "client", "server"
#: the bytes of a nonce, a challenge and a proof
SIZE = 32


def fresh() -> bytes:
    """A new random nonce or challenge (:data:`SIZE` bytes from :mod:`secrets`)."""
    return secrets.token_bytes(SIZE)


def proof(secret: bytes, side: str, server: str, connection: int, rank: int, challenge: bytes,
          nonce: bytes) -> bytes:
    """``side``'s proof (:data:`CLIENT` or :data:`SERVER`) for connection ``connection`` of
    client ``rank`` to the server of identity ``server``: HMAC-SHA256 of all of them, the
    server's ``challenge`` and the client's ``nonce``."""
    message = b"\n".join([PROTOCOL, side.encode(), server.encode(), str(connection).encode(), str(rank).encode(),
                          challenge.hex().encode(), nonce.hex().encode()])
    return hmac.new(secret, message, hashlib.sha256).digest()


def matches(got: bytes, expected: bytes) -> bool:
    """Whether a received proof is the expected one (in constant time)."""
    return hmac.compare_digest(got, expected)
