"""The two namespaced hosts of ``shmtrain bench hosts`` and one job on them.

Two "hosts" are two network namespaces (``st<pid>a``, ``st<pid>b``, addresses 10.77.x.1
and .2) joined by a veth pair (``st<pid>va`` in a, ``st<pid>vb`` in b) whose both ends
are shaped with ``tc qdisc add dev DEV root tbf rate RATE burst 256kb latency 50ms``
(``none`` leaves the link as fast as the kernel copies). A job is one
``python -m torch.distributed.run --nnodes N --node-rank K --nproc-per-node 2 ...``
per host inside its namespace (``ip netns exec``). The bytes that crossed the link
during a job are the veth's counters (``ip -s link``: sent + received on host a's end,
IP and TCP headers included) read before and after it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

NODES, PER_NODE = 2, 2


class HostsUnavailable(ValueError):
    """This machine cannot make the two namespaced hosts (the message says why)."""


def why_not(rate: str) -> str | None:
    """Why two namespaced hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (run it as root, e.g. with sudo)"
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip() or 'exit status ' + str(probe.returncode)}"
    if rate != "none" and shutil.which("tc") is None:
        return "the `tc` tool (iproute2) is not installed, which shapes the link (or pass --rate none)"
    return None


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise HostsUnavailable(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


def _kill_inside(ns: str) -> None:
    """End what still runs in namespace ``ns`` (only this bench's processes are there)."""
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


@contextmanager
def two_hosts(rate: str) -> Iterator[tuple[str, str, str]]:
    """Two namespaces and a veth pair between them, shaped to ``rate`` both ways unless
    ``none``: yields (namespace a, namespace b, address of a); both are deleted on exit."""
    tag = f"st{os.getpid() % 100000}"
    a, b, subnet = f"{tag}a", f"{tag}b", f"10.77.{os.getpid() % 250}"
    made: list[str] = []
    try:
        for ns in (a, b):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb")
        for ns, dev, last in ((a, f"{tag}va", 1), (b, f"{tag}vb", 2)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{subnet}.{last}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if rate != "none":
                _ip("netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                    "rate", rate, "burst", "256kb", "latency", "50ms")
        yield a, b, f"{subnet}.1"
    finally:
        for ns in made:
            _kill_inside(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # the veth pair goes with it


def link_bytes(ns: str, dev: str | None = None) -> int:
    """Bytes sent plus received on the veth end ``dev`` inside namespace ``ns`` (default:
    host a's end of :func:`two_hosts`' pair, ``st<pid>va`` in ``st<pid>a``)."""
    dev = dev or f"{ns[:-1]}v{ns[-1]}"
    info = json.loads(subprocess.run(["ip", "-n", ns, "-j", "-s", "link", "show", "dev", dev],
                                     check=True, capture_output=True, text=True).stdout)[0]["stats64"]
    return int(info["tx"]["bytes"]) + int(info["rx"]["bytes"])


def host_env() -> dict[str, str]:
    """A namespaced host's environment: as a new user has it (no GLOO_SOCKET_IFNAME), one
    torch thread per worker, no progress line, start-up marks in the logs
    (:mod:`shmtrain.startup`)."""
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    return dict(env, OMP_NUM_THREADS="1", SHMTRAIN_NO_PROGRESS="1", SHMTRAIN_STARTUP_LOG="1")


#: the launchers a job's hosts run: torchrun, or ``shmtrain torchrun`` (torchrun forking its
#: workers from one process that imported torch and shmtrain, :mod:`shmtrain.fork_torchrun`)
LAUNCHERS = {"torchrun": ["-m", "torch.distributed.run"], "fork": ["-m", "shmtrain", "torchrun"]}


def launch(hosts: tuple[str, str, str], port: int, worker: list[str], logs: Path, name: str,
           limit: float, nodes: int = NODES, launcher: str = "torchrun",
           env: dict[str, str] | None = None) -> tuple[float, float, int]:
    """Run ``worker`` (``-m module ...`` for torchrun, ``train ...`` or a script for
    ``fork``) as one job of ``launcher`` (:data:`LAUNCHERS`) on the first ``nodes`` hosts
    (2 workers each), ``env`` added to :func:`host_env`; returns (launch time, wall seconds,
    link bytes). A failure or a job
    past ``limit`` seconds raises RuntimeError naming its logs (``logs/NAME-node<K>.log``)."""
    a, b, master = hosts
    logs.mkdir(parents=True, exist_ok=True)
    procs, files = [], []
    before = link_bytes(a)
    start = time.time()
    try:
        for node, ns in enumerate((a, b)[:nodes]):
            cmd = ["ip", "netns", "exec", ns, sys.executable, *LAUNCHERS[launcher], "--nnodes", str(nodes),
                   "--node-rank", str(node), "--nproc-per-node", str(PER_NODE), "--master-addr", master,
                   "--master-port", str(port), "--rdzv-conf", "timeout=60", *worker]
            sink = open(logs / f"{name}-node{node}.log", "w")  # noqa: SIM115 - closed below
            files.append(sink)
            procs.append(subprocess.Popen(cmd, env=dict(host_env(), **(env or {})), stdout=sink,
                                          stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + limit
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        wall = time.time() - start
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for f in files:
            f.close()
    codes = [p.returncode for p in procs]
    if any(codes):
        tail = (logs / f"{name}-node0.log").read_text(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"bench hosts: {name} failed (exit status {codes}, limit {limit:.0f} s); "
                           f"see {logs}/{name}-node*.log; node 0's last lines:\n  " + "\n  ".join(tail))
    return start, wall, link_bytes(a) - before
