"""``shmtrain bench smb --remote``: the remote buffer service against gloo on the same link.

ShmCaffe Fig. 7 reads and writes the remote SMB at 96% of the HCA's bandwidth. Here, in
one run per client count: a :class:`~shmtrain.fabric.smb.server.MemoryServer` in this
process and ``P`` workers as its clients. First the link itself: gloo send/recv of
the same bytes between the same endpoints, on the server's own process group (server
to every client at once: ``gloo-read``; every client to the server: ``gloo-write``);
then the service's ``read``, ``write``, ``readwrite`` and ``accumulate`` through the
protocol. Aggregate bandwidth is every client's bytes over the slowest client's time;
``vs gloo`` is read against gloo-read, write against gloo-write, and readwrite (half
each, Fig. 7's workload) against the same mix of the two.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist

from shmtrain.bench.common import bench_buffers, median, timed_rounds
from shmtrain.fabric.job.context import ProcessContext
from shmtrain.fabric.smb.remote import RemoteBufferService
from shmtrain.fabric.smb.server import MemoryServer
from shmtrain.runtime.launch.launcher import launch

OPS = ("read", "write", "readwrite", "accumulate")
RAW = ("gloo-read", "gloo-write")
_TAG_RAW = 9


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _row(ctx: ProcessContext, op: str, nbytes: int, reps: int, times: list[float]) -> dict[str, Any]:
    seconds = median(times)
    return {"procs": ctx.world_size, "op": op, "bytes": nbytes, "reps": reps, "median_s": seconds,
            "aggregate_GBps": ctx.world_size * reps * nbytes / seconds / 1e9}


def _worker(ctx: ProcessContext, payload: dict[str, Any]) -> list[dict[str, Any]]:
    nbytes, reps, samples = payload["bytes"], payload["reps"], payload["samples"]
    numel = nbytes // 4
    service = RemoteBufferService(payload["address"], ctx.rank, ctx.world_size, timeout=300)
    private = torch.ones(numel)
    rows = []
    raw = {"gloo-read": lambda i: service.pg.recv([private], 0, _TAG_RAW).wait(),
           "gloo-write": lambda i: service.pg.send([private], 0, _TAG_RAW).wait()}
    for op in RAW:  # the link: the server's process group, no protocol
        rows.append(_row(ctx, op, nbytes, reps, timed_rounds(raw[op], reps, samples, dist.barrier, _slowest)))
    shared, own = bench_buffers(service, numel)
    ops = {
        "read": lambda i: service.read(own, private),
        "write": lambda i: service.write(own, private),
        "readwrite": lambda i: service.read(own, private) if i % 2 == 0 else service.write(own, private),
        "accumulate": lambda i: service.wait(service.accumulate(own, shared)),
    }
    for op in payload["ops"]:
        rows.append(_row(ctx, op, nbytes, reps, timed_rounds(ops[op], reps, samples, dist.barrier, _slowest)))
    service.close()
    return rows


def _serve_raw(server: MemoryServer, numel: int, reps: int, samples: int) -> None:
    """The server's side of the gloo-read / gloo-write phase (same order as the clients)."""
    server.connect()
    buffers = {c: torch.ones(numel) for c in range(1, server.clients + 1)}
    for op in RAW:
        for _ in range((samples + 1) * reps):
            if op == "gloo-read":
                works = [server.link(c).send([buffers[c]], 1, _TAG_RAW) for c in buffers]
            else:
                works = [server.link(c).recv([buffers[c]], 1, _TAG_RAW) for c in buffers]
            for work in works:
                work.wait()


def run(procs: list[int], nbytes: int, reps: int, samples: int, ops: list[str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for p in procs:
        print(f"... {p} clients of one memory server", flush=True)
        server = MemoryServer(p, timeout=300, log=lambda line: print(line, flush=True))
        payload = {"address": server.address, "bytes": nbytes, "reps": reps, "samples": samples, "ops": ops}
        result: list[Any] = []
        clients = threading.Thread(
            target=lambda pl=payload, n=p, out=result: out.append(launch("shmtrain.bench.smb_remote:_worker", n, pl,
                                                                timeout=600)),
            name="bench-clients", daemon=True)
        clients.start()
        _serve_raw(server, nbytes // 4, reps, samples)
        server.serve()
        clients.join()
        if not result:
            raise RuntimeError("the benchmark's workers failed; see the messages above")
        rows += result[0][0]
    for row in rows:
        same = {r["op"]: r["aggregate_GBps"] for r in rows if r["procs"] == row["procs"]}
        if row["op"] in ("read", "write") and f"gloo-{row['op']}" in same:
            row["vs_gloo"] = row["aggregate_GBps"] / same[f"gloo-{row['op']}"]
        elif row["op"] == "readwrite" and {"gloo-read", "gloo-write"} <= set(same):
            # half reads, half writes (ShmCaffe Fig. 7's workload): the link's time for the
            # same mix is the mean of its read and write times (a harmonic mean of rates)
            link = 2 / (1 / same["gloo-read"] + 1 / same["gloo-write"])
            row["vs_gloo"] = row["aggregate_GBps"] / link
    return rows
