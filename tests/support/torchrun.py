"""Jobs across hosts on this machine: torchrun launches (plain, or ``shmtrain torchrun``
whose workers are forked from its agent), free loopback ports, the agents' workers and
their progress."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import torch

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
#: torchrun whose workers are forked from its agent (one import of torch per host)
FORK = [sys.executable, "-m", "shmtrain", "torchrun"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict[str, str]:
    """This process's environment for a launch: one OpenMP thread per worker, no progress bar."""
    return dict(os.environ, OMP_NUM_THREADS="1", SHMTRAIN_NO_PROGRESS="1")


def start_hosts(out: Path, args: list[str], nodes: int = 2, per_node: int = 2,
                forked: tuple[int, ...] = ()) -> list[subprocess.Popen]:
    """Start ``nodes`` torchrun launches on this machine, each one host of ``per_node``
    workers running ``shmtrain train ARGS --out OUT`` (output piped, not waited for); the
    hosts in ``forked`` through ``shmtrain torchrun`` (workers forked from its agent)."""
    port = free_port()
    return [subprocess.Popen(host_command(node, nodes, per_node, port, [*args, "--out", str(out)],
                                          fork=node in forked),
                             env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for node in range(nodes)]


def host_command(node: int, nodes: int, per_node: int, port: int, args: list[str], fork: bool = False) -> list[str]:
    """The torchrun command of host ``node`` running ``shmtrain train ARGS`` on loopback
    (``fork``: ``shmtrain torchrun``, the same options)."""
    launcher, train = (FORK, ["train"]) if fork else (TORCHRUN, ["-m", "shmtrain", "train"])
    return launcher + ["--nnodes", str(nodes), "--node-rank", str(node), "--nproc-per-node", str(per_node),
                       "--master-addr", "127.0.0.1", "--master-port", str(port), *train, *args]


def two_hosts(out: Path, common: list[str], nodes: int = 2, per_node: int = 2, forked: tuple[int, ...] = ()) -> None:
    """``nodes`` torchrun launches on this machine, each one host of ``per_node`` workers,
    run to their end; every one must exit 0."""
    procs = start_hosts(out, common, nodes, per_node, forked)
    outputs = [p.communicate(timeout=170)[0].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs


def same_weights(one: Path, other: Path) -> None:
    """The ``model.pt`` of two run folders agree to a relative error of 1e-5 per tensor."""
    a, b = torch.load(one / "model.pt"), torch.load(other / "model.pt")
    for key in a:
        assert float((b[key] - a[key]).norm() / a[key].norm()) < 1e-5, (other.name, key)


def training_rows(path: Path) -> int:
    """The training rows (not the evaluations) of a metrics file so far; 0 before it exists."""
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip() and '"eval"' not in line)
    except FileNotFoundError:
        return 0


def agent_workers(agent: psutil.Process) -> dict[int, psutil.Process]:
    """A torchrun agent's workers by local rank (its children, not theirs: a memory server)."""
    found = {}
    for child in agent.children():
        try:
            rank = child.environ().get("LOCAL_RANK")
        except psutil.Error:
            continue
        if rank is not None:
            found[int(rank)] = child
    return found
