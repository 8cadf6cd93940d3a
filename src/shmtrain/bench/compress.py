"""``shmtrain bench compress``: how fast ``--compress`` compresses and decompresses on the CPU.

For each spec, a float32 vector of ``--numel`` normal values goes through
:meth:`~shmtrain.fabric.compress.codec.Compressor.encode` (the top-k selection, the B-bit
values, the packing and the error feedback: what a host's leader does per exchange) and
through :meth:`~shmtrain.fabric.compress.codec.Compressor.mean` of one payload (what every
leader does per host and exchange), on ``--threads`` torch threads. The rate is the
dense vector's bytes over the best of ``--repeats`` calls, timed in the calling
thread's CPU seconds (``cpu GB/s``: what a core does, whatever else the machine runs;
with one torch thread the call runs on that thread) and in wall seconds (``wall GB/s``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from shmtrain.bench.common import table, write_json
from shmtrain.fabric import native
from shmtrain.fabric.compress.codec import Compressor, CompressSpec, parse_compress

DEFAULT_SPECS = ["topk:0.01,bits:4", "topk:0.01,bits:2", "topk:0.1,bits:8"]


def _best(call: Callable[[], object], repeats: int) -> tuple[float, float]:
    """The fastest of ``repeats`` calls: (CPU seconds of this thread, wall seconds)."""
    cpu, wall = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.thread_time()
        call()
        cpu.append(time.thread_time() - start_cpu)
        wall.append(time.perf_counter() - start)
    return min(cpu), min(wall)


def _same(numel: int, spec: CompressSpec, delta: torch.Tensor) -> bool:
    """Whether the encoder measured and the torch path send the same D(C(Δ)) and keep the
    same e, bit for bit, from fresh state (the baseline ran, and on the same problem)."""
    sides = []
    for use_native in (True, False):
        comp, out = Compressor(numel, spec, use_native), torch.empty(numel)
        sides.append((comp.mean([comp.encode(delta)], out), comp.error))
    return all(torch.equal(a, b) for a, b in zip(*sides, strict=True))


def measure(numel: int, spec: CompressSpec, repeats: int = 10, threads: int = 1) -> dict[str, Any]:
    """GB/s of the dense float32 vector through ``encode`` (with feedback) and ``mean``,
    per CPU second of the calling thread and per wall second; beside it, in the same run,
    the torch path's encode (the baseline: ``torch_compress_gb_s``, ``speedup``)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        delta = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        comp, out = Compressor(numel, spec), torch.empty(numel)
        baseline = Compressor(numel, spec, native=False)
        comp.encode(delta), baseline.encode(delta)  # warm
        encode_s = _best(lambda: comp.encode(delta), repeats)
        torch_s = _best(lambda: baseline.encode(delta), repeats)
        decode_s = _best(lambda: comp.mean([comp.payload], out), repeats)
        same = _same(numel, spec, delta)
    finally:
        torch.set_num_threads(previous)
    dense = 4 * numel
    encoder = "C" if native.library() is not None else f"torch ({native.why_not})"
    return {"numel": numel, "compress": spec.text(), "encoder": encoder, "threads": threads, "repeats": repeats,
            "torch_compress_gb_s": dense / torch_s[0] / 1e9, "speedup": torch_s[0] / encode_s[0],
            "same_as_torch": same,
            "payload_bytes": comp.codec.nbytes, "ratio": dense / comp.codec.nbytes,
            "compress_cpu_ms": encode_s[0] * 1e3, "decompress_cpu_ms": decode_s[0] * 1e3,
            "compress_gb_s": dense / encode_s[0] / 1e9, "decompress_gb_s": dense / decode_s[0] / 1e9,
            "compress_wall_gb_s": dense / encode_s[1] / 1e9, "decompress_wall_gb_s": dense / decode_s[1] / 1e9}


def run(numel: int, specs: list[str], repeats: int = 10, threads: int = 1,
        json_path: str | None = None) -> list[dict[str, Any]]:
    """One row per spec: printed as a table, written to ``json_path`` when given."""
    parsed = []
    for text in specs:
        spec = parse_compress(text)
        if spec is None:
            raise ValueError(f"--compress {text!r}: there is nothing to measure without compression; "
                             "pass e.g. --compress topk:0.01,bits:4")
        parsed.append(spec)
    rows = [measure(numel, spec, repeats, threads) for spec in parsed]
    print(table(rows, [("compress", "compress", "s"), ("encoder", "encoder", "s"), ("payload_bytes", "payload B", "d"),
                       ("ratio", "ratio", ".1f"),
                       ("compress_gb_s", "comp cpu GB/s", ".2f"), ("torch_compress_gb_s", "torch comp", ".2f"),
                       ("speedup", "x torch", ".2f"), ("same_as_torch", "same bits", ""),
                       ("decompress_gb_s", "decomp cpu GB/s", ".2f"),
                       ("compress_wall_gb_s", "comp wall GB/s", ".2f"),
                       ("decompress_wall_gb_s", "decomp wall GB/s", ".2f")]))
    write_json(json_path, rows)
    return rows


def _handler(args: argparse.Namespace) -> int:
    run(args.numel, args.compress, args.repeats, args.threads, args.json)
    return 0


def add_bench_compress_parser(bench: argparse._SubParsersAction) -> None:
    """Register ``shmtrain bench compress``."""
    p = bench.add_parser("compress", help="--compress's compression and decompression rate on the CPU",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=1 << 22, help="float32 elements of the vector (default 4Mi)")
    p.add_argument("--compress", nargs="+", default=DEFAULT_SPECS,
                   help=f"specs as for train --compress (default {' '.join(DEFAULT_SPECS)})")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--repeats", type=int, default=10, help="calls per rate; the best counts (default 10)")
    p.add_argument("--json", help="write the rows here")
    p.set_defaults(handler=_handler)
