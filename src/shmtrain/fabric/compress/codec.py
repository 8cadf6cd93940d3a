"""Compressed exchanges: chunked top-k with low-bit values and error feedback, vectorised
in torch on the CPU (``--compress topk:F,bits:B``).

SparseLoCo (Sarfi et al. 2025, "Communication-Efficient Language Model Training Scales
Reliably and Robustly: SparseLoCo") sends DiLoCo's pseudo-gradient as the top-k of each
chunk with 2-bit values and keeps what was not sent for the next exchange (error
feedback, Karimireddy et al. 2019, "Error Feedback Fixes SignSGD", Algorithm 2)::

    a   = Δ + e            the vector plus what earlier exchanges left out
    c   = C(a)             top-k of every chunk of CHUNK elements, values quantised to B bits
    e  ← a − D(c)          kept for the next exchange (per tensor, in the checkpoint)

The payload of one vector has a fixed size (all-gathered as bytes): per chunk one float32
scale (its largest kept magnitude; float32 values instead when B = 32), k int16 indices
into the chunk, and k values of B bits packed into bytes. ``D`` scatters the values back
into a dense vector; the mean of several hosts' payloads is their scatter-added sum
over their count.

Where the machine's C compiler built ``compress_native.c`` (:mod:`shmtrain.fabric.native`),
the encoder with its error feedback is one C pass per chunk while the chunk is in L1 (the
same kept places up to ties among equal magnitudes, the same arithmetic); otherwise, or
with ``SHMTRAIN_NATIVE=0``, the torch path below runs. Decoding is torch's scatter-add.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

from shmtrain.fabric import native

#: elements per chunk: int16 indices address it; top-k is taken per chunk (one torch.topk over rows)
CHUNK = 4096
#: elements of a group (j, j + chunk/GROUP, ...): the groups' maxima pick top-k's candidates
GROUP = 8
#: the value widths: 2, 4, 8 bits (uniform, symmetric, a scale per chunk) or 32 (float32 as is)
BITS = (2, 4, 8, 32)
_FIX = "pass e.g. --compress topk:0.01,bits:4 (or leave --compress out for the exact exchange)"


@dataclass(frozen=True, slots=True)
class CompressSpec:
    """What ``--compress`` asks for: the kept ``fraction`` F of every chunk, the value
    width ``bits`` B, and whether what was left out is fed back (``feedback``)."""

    fraction: float = 1.0
    bits: int = 32
    feedback: bool = True

    def text(self) -> str:
        """The option's spelling of this spec (``parse_compress(spec.text()) == spec``)."""
        return f"topk:{self.fraction:g},bits:{self.bits}" + ("" if self.feedback else ",feedback:off")


def _plain(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    """Contiguous ``dtype`` in CPU memory: what the C encoder reads through a pointer."""
    return tensor.device.type == "cpu" and tensor.dtype == dtype and tensor.is_contiguous()


def _bad(value: str, rule: str) -> ValueError:
    return ValueError(f"--compress {value!r}: {rule}; {_FIX}")


def parse_compress(text: str | None) -> CompressSpec | None:
    """``topk:F,bits:B[,feedback:off]`` (either key may be left out: F = 1, B = 32) as a
    :class:`CompressSpec`; None for ``""`` or ``none`` (no compression). ValueError names
    the option, the value, the rule and the fix."""
    if text is None or str(text).strip().lower() in ("", "none", "off"):
        return None
    if not isinstance(text, str):
        raise _bad(str(text), "must be a string of key:value pairs separated by commas")
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition(":")
        if not sep or key not in ("topk", "bits", "feedback"):
            raise _bad(text, f"{part.strip()!r} is not one of topk:F, bits:B, feedback:on|off")
        if key in fields:
            raise _bad(text, f"{key} is given twice")
        fields[key] = value.strip()
    try:
        fraction = float(fields.get("topk", "1"))
    except ValueError:
        raise _bad(text, f"topk:{fields['topk']} must be a number in (0, 1], the kept share of every "
                         "chunk") from None
    if not (0 < fraction <= 1) or math.isnan(fraction):
        raise _bad(text, f"topk:{fields['topk']} must lie in (0, 1]: the kept share of every chunk")
    bits_text = fields.get("bits", "32")
    if not bits_text.isdigit() or int(bits_text) not in BITS:
        raise _bad(text, f"bits:{bits_text} must be one of {', '.join(map(str, BITS))} (the value width)")
    feedback = fields.get("feedback", "on")
    if feedback not in ("on", "off"):
        raise _bad(text, f"feedback:{feedback} must be on or off (error feedback)")
    return CompressSpec(fraction, int(bits_text), feedback == "on")


class Codec:
    """The fixed payload layout of a vector of ``numel`` elements under ``spec``:
    ``chunks`` rows of ``chunk`` elements (the last padded with zeros), ``k`` kept per row.
    ``native``: encode through the C encoder where it was built (False: always torch)."""

    def __init__(self, numel: int, spec: CompressSpec, native: bool = True) -> None:
        self.numel, self.spec, self.native = numel, spec, native
        self.chunk = max(1, min(CHUNK, numel))
        self.chunks = -(-numel // self.chunk)
        self.k = max(1, min(self.chunk, round(spec.fraction * self.chunk)))
        kept = self.chunks * self.k
        self.qmax = (1 << (spec.bits - 1)) - 1 if spec.bits < 32 else 0
        self.per_byte = 8 // spec.bits if spec.bits < 32 else 0
        floats = kept if spec.bits == 32 else self.chunks  # values, or one scale per chunk
        self._index_at = 4 * floats
        self._packed_at = self._index_at + 2 * kept
        packed = 0 if spec.bits == 32 else -(-kept // self.per_byte)
        #: bytes of one payload (what one host's leader puts on the link per exchange)
        self.nbytes = self._packed_at + packed
        if self.per_byte:
            self._shifts = torch.arange(self.per_byte, dtype=torch.uint8) * spec.bits
        #: the two-stage selection (below) when the candidates are a small share of a chunk
        self._staged = self.chunk % GROUP == 0 and self.k * GROUP * 4 <= self.chunk
        width = self.chunk // GROUP
        self._offsets = torch.arange(GROUP) * width
        self._magnitudes: torch.Tensor | None = None  # the torch path's |x|, made on its first use
        self._scratch: torch.Tensor | None = None  # the C encoder's, made on its first use

    def select(self, rows: torch.Tensor) -> torch.Tensor:
        """The places of the k largest magnitudes of every row (chunks, k), exactly (up to
        ties). In two stages when k is small: a row's elements fall into ``chunk / GROUP``
        strided groups (group j holds j, j + chunk/GROUP, ...: GROUP elements); an element
        of the top k has at most k − 1 larger ones, so at most k − 1 groups have a larger
        maximum than its group, which is therefore among the k groups with the largest
        maxima. torch.topk then runs over the groups' maxima and the k · GROUP candidates
        instead of the whole row (the data itself is read once, for |x| and the maxima)."""
        if self._magnitudes is None:
            self._magnitudes = torch.empty(self.chunks, self.chunk, dtype=torch.float32)
        magnitudes = torch.abs(rows, out=self._magnitudes)
        if not self._staged:
            return torch.topk(magnitudes, self.k, dim=1, sorted=False).indices
        width = self.chunk // GROUP
        maxima = magnitudes.view(self.chunks, GROUP, width).amax(dim=1)
        starts = torch.topk(maxima, self.k, dim=1, sorted=False).indices
        candidates = (starts.unsqueeze(2) + self._offsets).view(self.chunks, -1)
        best = torch.topk(torch.gather(magnitudes, 1, candidates), self.k, dim=1, sorted=False).indices
        return torch.gather(candidates, 1, best)

    # -- one payload --------------------------------------------------------------------
    def encode_native(self, acc: torch.Tensor, delta: torch.Tensor | None, payload: torch.Tensor,
                      feedback: bool) -> bool:
        """``shm_topk_encode_f32``: add ``delta`` into ``acc`` (float32, ``padded()``
        elements) when given, write C(acc) into ``payload`` and, with ``feedback``, take what
        was sent out of ``acc`` (error feedback's e). False, touching nothing, where the C
        library is not available or not wanted, or a tensor is not contiguous float32 in CPU
        memory (the caller then takes the torch path)."""
        lib = native.library() if self.native else None
        floats = (acc,) if delta is None else (acc, delta)
        if lib is None or not (_plain(payload, torch.uint8) and all(_plain(t, torch.float32) for t in floats)):
            return False
        if self._scratch is None:
            self._scratch = torch.zeros(lib.shm_topk_scratch_bytes(), dtype=torch.uint8)
        nbytes = payload.numel()
        base = payload.data_ptr()
        packed = base + self._packed_at if self._packed_at < nbytes else None
        lib.shm_topk_encode_f32(acc.data_ptr(), None if delta is None else delta.data_ptr(), self.numel, self.chunk,
                                self.chunks, self.k, self.spec.bits, base, base + self._index_at,
                                ctypes.c_void_p(packed), int(feedback), self._scratch.data_ptr())
        return True

    def compress(self, vector: torch.Tensor, payload: torch.Tensor) -> None:
        """Write C(vector) into ``payload``, no error feedback: the C encoder where it was
        built, else :meth:`encode`."""
        rows = self._rows(vector)
        if not self.encode_native(rows, None, payload, False):
            self.encode(rows, payload)

    def encode(self, vector: torch.Tensor, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write C(vector) into ``payload`` (uint8, ``nbytes``); return the kept places
        (chunks, k) and the values D(C(vector)) has there (for the error feedback)."""
        rows = self._rows(vector)
        index = self.select(rows)
        values = torch.gather(rows, 1, index)
        payload[self._index_at:self._packed_at].view(torch.int16).view(self.chunks, self.k).copy_(index)
        if self.spec.bits == 32:
            payload[:self._index_at].view(torch.float32).view(self.chunks, self.k).copy_(values)
            return index, values
        scale = values.abs().amax(dim=1, keepdim=True).div_(self.qmax)
        scale.masked_fill_(scale == 0, 1.0)
        q = values.div(scale).round_().clamp_(-self.qmax, self.qmax)
        payload[:self._index_at].view(torch.float32).copy_(scale.view(-1))
        self._pack(q.add(self.qmax).to(torch.uint8).view(-1), payload[self._packed_at:])
        return index, q.mul_(scale)

    def decode_add(self, payload: torch.Tensor, out: torch.Tensor, alpha: float = 1.0) -> None:
        """``out[:numel] += alpha · D(payload)`` (``out``: float32 with room for the padded
        chunks, ``chunks · chunk`` elements)."""
        index = payload[self._index_at:self._packed_at].view(torch.int16).view(self.chunks, self.k).long()
        if self.spec.bits == 32:
            values = payload[:self._index_at].view(torch.float32).view(self.chunks, self.k)
        else:
            scale = payload[:self._index_at].view(torch.float32).view(self.chunks, 1)
            q = self._unpack(payload[self._packed_at:]).view(self.chunks, self.k)
            values = q.to(torch.float32).sub_(self.qmax).mul_(scale)
        if alpha != 1.0:
            values = values * alpha
        out[:self.chunks * self.chunk].view(self.chunks, self.chunk).scatter_add_(1, index, values)

    def padded(self) -> int:
        """Elements of a dense buffer ``decode_add`` writes into."""
        return self.chunks * self.chunk

    def _rows(self, vector: torch.Tensor) -> torch.Tensor:
        flat = vector.reshape(-1)
        if flat.numel() == self.chunks * self.chunk:
            return flat.view(self.chunks, self.chunk)
        rows = torch.zeros(self.chunks * self.chunk, dtype=torch.float32)
        rows[:self.numel] = flat
        return rows.view(self.chunks, self.chunk)

    def _pack(self, codes: torch.Tensor, out: torch.Tensor) -> None:
        if self.per_byte == 1:
            out[:codes.numel()].copy_(codes)
            return
        whole = out.numel() * self.per_byte
        if codes.numel() != whole:
            codes = torch.cat([codes, codes.new_zeros(whole - codes.numel())])
        out.copy_((codes.view(-1, self.per_byte) << self._shifts).sum(1, dtype=torch.uint8))

    def _unpack(self, packed: torch.Tensor) -> torch.Tensor:
        kept = self.chunks * self.k
        if self.per_byte == 1:
            return packed[:kept]
        mask = (1 << self.spec.bits) - 1
        return ((packed.unsqueeze(1) >> self._shifts) & mask).view(-1)[:kept]


class Compressor:
    """One tensor's compression with its error feedback e (error feedback's Algorithm 2):
    ``encode`` sends C(Δ + e) and keeps e ← (Δ + e) − D(C(Δ + e)); without feedback e
    stays 0 (plain top-k). ``native``: as for :class:`Codec`."""

    def __init__(self, numel: int, spec: CompressSpec, native: bool = True) -> None:
        self.codec = Codec(numel, spec, native)
        self.spec = spec
        #: e, padded to whole chunks (the padding stays 0)
        self.error = torch.zeros(self.codec.padded(), dtype=torch.float32)
        self.payload = torch.empty(self.codec.nbytes, dtype=torch.uint8)

    def encode(self, delta: torch.Tensor) -> torch.Tensor:
        """The payload of C(Δ + e) (this object's buffer, overwritten by the next call)."""
        codec = self.codec
        flat = delta.reshape(-1).to(torch.float32).contiguous()
        if not self.spec.feedback:
            codec.compress(flat, self.payload)
            return self.payload
        acc = self.error
        if codec.encode_native(acc, flat, self.payload, True):
            return self.payload
        acc[:codec.numel].add_(flat)
        index, sent = codec.encode(acc, self.payload)
        acc.view(codec.chunks, codec.chunk).scatter_add_(1, index, sent.neg_())
        return self.payload

    def mean(self, payloads: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """``out`` ← the mean of D(payload) over ``payloads`` (``out``: ``numel`` float32)."""
        dense = torch.zeros(self.codec.padded(), dtype=torch.float32)
        for payload in payloads:
            self.codec.decode_add(payload, dense, 1.0 / len(payloads))
        out.copy_(dense[:self.codec.numel])
        return out

    def state_dict(self) -> dict[str, object]:
        return {"spec": self.spec.text(), "error": self.error.clone()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        error = state["error"]
        if state.get("spec") != self.spec.text() or not isinstance(error, torch.Tensor) \
                or error.numel() != self.error.numel():
            raise ValueError(f"the checkpoint's error feedback is for --compress {state.get('spec')} over "
                             f"{getattr(error, 'numel', lambda: '?')()} elements, this run's for --compress "
                             f"{self.spec.text()} over {self.error.numel()}: resume with the --compress and "
                             "the model the checkpoint was written with")
        self.error.copy_(error)
