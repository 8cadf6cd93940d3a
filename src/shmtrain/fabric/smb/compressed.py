"""SMB-REMOTE's compressed exchange: what a client on another host sends and receives
instead of whole buffers (``--compress`` for easgd, seasgd and hsgd).

A worker whose memory server is across a slow link moved the whole W_g each way per
exchange (4.5 MB for wide_mlp: 15 iterations to the near host's 785 on 100 Mbit/s). With
``--compress topk:F,bits:B`` (:mod:`shmtrain.fabric.compress.codec`'s C and D, its fixed-size
payload) it exchanges compressed differences instead:

- **up** (``OP_CACCUMULATE``): the increment dW_x (eq. (5)) as ``C(dW_x + e_x)`` with the
  worker's own error feedback e_x (:class:`~shmtrain.fabric.compress.codec.Compressor`); the
  server adds ``D(payload)`` into W_g, exclusively, as it applies an accumulate (eq. (7)).
- **down** (``OP_CREAD``): the server keeps, per client and buffer, the copy of W_g that
  client holds (its *mirror* m_c); a read sends ``c = C(W_g − m_c)`` and both sides do
  ``m_c += D(c)``. What was left out, ``W_g − m_c``, is the next read's difference by
  construction, so this direction needs no feedback of its own. The worker uses its
  mirror as W_g in the elastic update.
- **(re)connect**: a mirror lives as long as the client's link (a connection of the
  rank again, after a lost host or a resume from a checkpoint, starts without one): the
  client's first read of a buffer is dense (``d = 1``: the whole buffer, which both sides
  take as the mirror), every later one compressed; a compressed read the server holds no
  mirror for is answered with an error, never with a difference against the wrong copy.

Framing is the wire's (:mod:`~shmtrain.fabric.smb.wire`): header ``[op, seq, buffer id,
numel, code, dense]`` with ``code = k << 8 | B`` (k kept per chunk of
:data:`~shmtrain.fabric.compress.codec.CHUNK`); the status reply comes before any payload. An
accumulate's payload is sent only after an OK (a refused one leaves nothing in flight),
received by a watcher thread off the serving loop and applied once whole; the
notification that it was applied is a second reply (tag kind ``VERDICT``).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any  # the server: server.py's MemoryServer, which imports this

import torch

from shmtrain.fabric.compress.codec import BITS, CHUNK, Codec, Compressor, CompressSpec
from shmtrain.fabric.smb.api import Buffer
from shmtrain.fabric.smb.wire import OK, OP_CACCUMULATE, OP_CREAD, PAYLOAD_IN, REPLY_WORDS, TO_CLIENT, VERDICT, tag

if TYPE_CHECKING:
    from shmtrain.fabric.smb.remote import RemoteBufferService

COMPRESSED_OPS = (OP_CREAD, OP_CACCUMULATE)


def spec_code(codec: Codec) -> int:
    """The header word that names a codec: k kept per chunk and the value width B."""
    return codec.k << 8 | codec.spec.bits


def codec_of(numel: int, code: int) -> Codec | None:
    """The codec a client named by :func:`spec_code` for a buffer of ``numel``; None when
    the word names none."""
    bits, k = code & 0xFF, code >> 8
    chunk = max(1, min(CHUNK, numel))
    if bits not in BITS or not 1 <= k <= chunk:
        return None
    codec = Codec(numel, CompressSpec(k / chunk, bits))
    return codec if codec.k == k else None


# -- the server's side ---------------------------------------------------------------------
def serve_compressed(server: Any, client: int, header: torch.Tensor) -> None:
    """Answer a compressed read or accumulate of ``client`` (a trusted one)."""
    op, seq, buffer_id, numel, code, dense = (int(x) for x in header[:6])
    tensor = server.buffers.get(buffer_id)
    codec = codec_of(numel, code) if numel > 0 else None
    if tensor is None or tensor.numel() != numel or tensor.dtype != torch.float32 or codec is None:
        return server.bad(client, seq, f"{'compressed read' if op == OP_CREAD else 'compressed accumulate'} of "
                                        f"buffer {buffer_id} with {numel} elements and code {code}: no such float32 "
                                        "buffer, or no such compression")
    if op == OP_CREAD:
        return _read(server, client, seq, buffer_id, codec, bool(dense))
    payload = torch.empty(codec.nbytes, dtype=torch.uint8)
    work = server.links[client].recv([payload], 1, tag(seq, PAYLOAD_IN))
    _apply_when_whole(server, client, seq, work, payload, buffer_id, codec)
    server.reply(client, OK, seq)


def _mirrors(server: Any) -> dict[tuple[int, int], tuple[int, torch.Tensor]]:
    """(client, buffer id) -> (the connection it was made on, the client's copy, padded)."""
    return server.__dict__.setdefault("mirrors", {})


def _scratch(server: Any, padded: int) -> torch.Tensor:
    """Where a read's difference is formed: one per size for the whole server, since its one
    serving thread answers requests one at a time and a difference is encoded before the
    reply. Only ``[:numel]`` is ever written, so the padding stays zero."""
    scratches = server.__dict__.setdefault("scratches", {})
    if padded not in scratches:
        scratches[padded] = torch.zeros(padded, dtype=torch.float32)
    return scratches[padded]


def _read(server: Any, client: int, seq: int, buffer_id: int, codec: Codec, dense: bool) -> None:
    mirrors, generation = _mirrors(server), server.generation[client]
    entry = mirrors.get((client, buffer_id))
    if dense:
        mirror = torch.zeros(codec.padded(), dtype=torch.float32)
        with server.lock:
            mirror[:codec.numel].copy_(server.buffers[buffer_id])
        mirrors[(client, buffer_id)] = (generation, mirror)
        payload = mirror[:codec.numel]  # the client's next request waits until it has left
    elif entry is None or entry[0] != generation or entry[1].numel() != codec.padded():
        return server.bad(client, seq, f"compressed read of buffer {buffer_id} without a dense read first on this "
                                        "connection (no copy of what the client holds)")
    else:
        mirror = entry[1]
        difference = _scratch(server, codec.padded())
        with server.lock:
            torch.sub(server.buffers[buffer_id], mirror[:codec.numel], out=difference[:codec.numel])
        payload = torch.empty(codec.nbytes, dtype=torch.uint8)
        codec.compress(difference, payload)
        codec.decode_add(payload, mirror)  # m_c += D(c), as the client does
    server.reply(client, OK, seq)
    server.track(client, "read", server.links[client].send([payload], 1, tag(seq, TO_CLIENT)), payload,
                  buffer_id)


def _apply_when_whole(server: Any, client: int, seq: int, work, payload: torch.Tensor, buffer_id: int,
                      codec: Codec) -> None:
    """Watch a compressed increment in flight (as the server watches a write): once every
    byte has arrived, add D(payload) into the buffer exclusively and send the update
    notification; a client lost mid-payload changes nothing."""
    finished, failure = threading.Event(), []

    def watch() -> None:
        try:
            work.wait()
            dense = torch.zeros(codec.padded(), dtype=torch.float32)
            codec.decode_add(payload, dense)
            with server.lock:
                server.buffers[buffer_id].add_(dense[:codec.numel])  # eq. (7), one at a time
                server.applied += 1
                applied = server.applied
            server.reply(client, OK, seq, applied, kind=VERDICT)
        except RuntimeError as exc:
            failure.append(exc)
        finally:
            finished.set()

    server.inflight.setdefault(client, []).append(("caccumulate", work, payload, buffer_id, finished, failure))
    threading.Thread(target=watch, name=f"smb-caccumulate-{client}", daemon=True).start()


# -- the client's side ---------------------------------------------------------------------
class CompressedGlobal:
    """A client's compressed view of one remote float32 buffer (W_g): its mirror of the
    buffer (what :meth:`read` returns) and its error feedback on what it adds into it.

    Args:
        service: the remote buffer service (this worker's connection).
        buffer: the buffer (W_g).
        spec: ``--compress``'s (feedback on or off applies to the increments).
    """

    def __init__(self, service: RemoteBufferService, buffer: Buffer, spec: CompressSpec) -> None:
        if buffer.key.dtype != "float32":
            raise ValueError(f"--compress {spec.text()}: the global weights are {buffer.key.dtype}; the compressed "
                             "exchange carries float32 only; leave --compress out")
        self.service, self.buffer, self.spec = service, buffer, spec
        self.compressor = Compressor(buffer.numel, spec)
        self.codec = self.compressor.codec
        self.mirror = torch.zeros(self.codec.padded(), dtype=torch.float32)
        self.synced = False  #: whether this connection's dense read has happened
        self._landing = torch.empty(self.codec.nbytes, dtype=torch.uint8)
        #: bytes of payload this client received and sent (headers and replies left out)
        self.bytes_down = self.bytes_up = 0

    def read(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` ← W_g as this client holds it (the mirror, brought up to date)."""
        service, buffer, codec = self.service, self.buffer, self.codec
        dense = not self.synced
        landing = self.mirror[:codec.numel] if dense else self._landing
        what = f"compressed read of {buffer.key.name!r}"
        with service.lock:
            service.drain()
            seq, posted, payload = service.request(OP_CREAD, buffer.key.id, buffer.numel, spec_code(codec),
                                                    landing=landing, d=int(dense))
            service.status(seq, posted, what)
            service.call(payload.wait, what)
        if not dense:
            codec.decode_add(landing, self.mirror)
        self.synced = True
        self.bytes_down += landing.numel() * landing.element_size()
        out.copy_(self.mirror[:codec.numel].view_as(out))
        return out

    def accumulate(self, increment: torch.Tensor) -> int:
        """Add ``increment`` into W_g compressed (C(increment + e), e kept); returns when it
        has been applied, with the server's count of applied accumulates."""
        service, buffer = self.service, self.buffer
        payload = self.compressor.encode(increment.detach().reshape(-1).to("cpu", torch.float32))
        what = f"compressed accumulate into {buffer.key.name!r}"
        verdict = torch.zeros(REPLY_WORDS, dtype=torch.int64)
        with service.lock:
            service.drain()
            seq, posted, _ = service.request(OP_CACCUMULATE, buffer.key.id, buffer.numel, spec_code(self.codec))
            applied = (service.call(lambda: service.pg.recv([verdict], 0, tag(seq, VERDICT)), "posting a receive"),
                       verdict)
            service.status(seq, posted, what)  # an error: nothing more moves (the verdict is never sent)
            service.call(lambda: service.pg.send([payload], 0, tag(seq, PAYLOAD_IN)).wait(), what)
            service.status(seq, applied, what)
        self.bytes_up += payload.numel()
        return int(verdict[2])

    def state_dict(self) -> dict[str, object]:
        """The increments' error feedback and the spec (the mirror is not kept: a new
        connection starts with a dense read, so client and server agree after a resume)."""
        return self.compressor.state_dict()

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Refuses another spec or size, by name (:meth:`Compressor.load_state_dict`)."""
        self.compressor.load_state_dict(state)
