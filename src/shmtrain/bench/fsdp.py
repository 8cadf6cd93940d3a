"""``shmtrain bench fsdp``: an FSDP2 training step on the CPU, gloo against ``cpu:shm``.

``fully_shard`` on each layer and the root of an 8-layer MLP of 1024-wide Linear layers
(ReLU between; 8.4 M parameters, 33.6 MB), AdamW, batch 32 of random inputs per rank
(the same on both backends), ``--steps`` steps (default 30) per backend, one backend after
the other in fresh processes. Per backend: the median seconds per step after 3 warm-up
steps, the calls of each op that went through shared memory, and a digest of the final
weights (gathered whole on rank 0): the two must be bit-identical, else the run is
reported invalid.

``--floor`` adds a third run on torch's fake process group (``fake``: every collective
returns at once, moving nothing), the same processes, shards and steps: the step's time
without communication, the bound on what any backend can reach (its weights are not
compared: nothing was reduced; its unfilled buffers' denormals are flushed to zero, so that
garbage does not slow the arithmetic).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WARMUP = 3


def _rank(backend: str, rank: int, procs: int, port: int, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import shmtrain  # noqa: F401 - registers the "shm" backend
    from shmtrain.backend import ShmBackend

    torch.set_num_threads(1)
    if backend == "fake":  # the floor: collectives that move nothing
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=procs)
        # its gathers leave FSDP2's buffers as torch.empty made them: garbage whose denormals
        # would slow the arithmetic (measured: median 0.21 s against 0.09 s), not the step
        torch.set_flush_denormal(True)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=procs)
    mesh = init_device_mesh("cpu", (procs,))
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    model = nn.Sequential(*layers)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    times = []
    for step in range(WARMUP + steps):
        x, y = torch.randn(32, 1024, generator=g), torch.randn(32, 1024, generator=g)
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        elapsed = time.perf_counter() - start
        if step >= WARMUP:
            times.append(elapsed)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # fake: each rank's own (rank 0's reported)
    digest = hashlib.sha256()
    for name, param in model.state_dict().items():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        digest.update(name.encode())
        digest.update(full.detach().contiguous().numpy().tobytes())
    if rank == 0:
        Path(out).write_text(json.dumps({
            "backend": backend, "procs": procs, "steps": steps, "median_s": statistics.median(slowest.tolist()),
            "min_s": min(slowest.tolist()), "weights_sha256": digest.hexdigest(),
            "through_shm": dict(ShmBackend.through_shm), "through_gloo": dict(ShmBackend.through_gloo),
            "reductions": ShmBackend.reductions}))
    dist.barrier()
    dist.destroy_process_group()


def run(procs: int, steps: int, backends: list[str]) -> list[dict]:
    import socket

    rows = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="shmtrain-bench-fsdp-") as tmp:
        for backend in backends:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            out = os.path.join(tmp, f"{backend.replace(':', '-')}.json")
            ranks = [subprocess.Popen([sys.executable, "-m", "shmtrain.bench.fsdp", backend, str(r), str(procs),
                                       str(port), str(steps), out], env=env) for r in range(procs)]
            codes = [p.wait(timeout=3600) for p in ranks]
            if any(codes):
                raise RuntimeError(f"bench fsdp: the {procs} ranks on {backend} failed (exit codes {codes})")
            rows.append(json.loads(Path(out).read_text()))
    digests = {r["weights_sha256"] for r in rows if r["backend"] != "fake"}
    for r in rows:
        r["bit_identical"] = len(digests) == 1 if r["backend"] != "fake" else None
    return rows


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fsdp", help="an FSDP2 step on the CPU: gloo vs cpu:shm",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", type=int, default=2, help="processes (default 2)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per backend (default 30)")
    p.add_argument("--floor", action="store_true",
                   help="also run torch's fake process group (collectives move nothing): the step alone")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.set_defaults(handler=_main)


def _main(args: argparse.Namespace) -> int:
    if args.procs < 2 or args.steps < 1:
        raise ValueError(f"--procs {args.procs} --steps {args.steps}: at least 2 processes and 1 step; "
                         "e.g. --procs 2 --steps 30")
    rows = run(args.procs, args.steps, ["gloo", "cpu:shm"] + (["fake"] if args.floor else []))
    gloo, shm = rows[:2]
    print("| backend | median s per step | min s | weights |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['backend']} | {r['median_s']:.4f} | {r['min_s']:.4f} | {r['weights_sha256'][:12]} |")
    print(f"gloo / cpu:shm: {gloo['median_s'] / shm['median_s']:.2f}x; weights bit-identical: {shm['bit_identical']}; "
          f"cpu:shm calls through shared memory: {shm['through_shm']}, to gloo: {shm['through_gloo']}")
    if args.floor:
        floor = rows[2]["median_s"]
        print(f"floor (fake, no communication): {floor:.4f} s; gloo / floor: {gloo['median_s'] / floor:.2f}x, "
              f"cpu:shm / floor: {shm['median_s'] / floor:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if shm["bit_identical"] else 1


if __name__ == "__main__":
    backend, rank, procs, port, steps, out = sys.argv[1:]
    _rank(backend, int(rank), int(procs), int(port), int(steps), out)
