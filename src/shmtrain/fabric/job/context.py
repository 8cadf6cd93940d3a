"""Who this process is and how it reaches its peers: built once per worker from the env.

The environment is the one torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT); shmtrain's own launcher sets
the same variables plus ``SHMTRAIN_STORE_PORT`` (its store) and ``SHMTRAIN_CONTROL``
(the host's control block, which the launcher watches so it can abort the run when a
worker dies). The control plane is torch.distributed: its TCPStore for rendezvous and
a gloo process group for everything that crosses hosts.

A host lost from a running job and started again with the same torchrun command
*rejoins*: its workers count the starts of their node slot in the
job's store (:func:`_host_start`), find theirs is not the first, and build their
context without the job-wide gloo groups (the running hosts formed those once and
cannot take a new member), with a host group of their own under a fresh key and
segment namespace. Only strategies whose hosts meet at a memory server can run so
(``Strategy.rejoins``); they pull the global weights and their TERM counters from it.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from shmtrain.fabric.job import hosts
from shmtrain.fabric.job.netif import choose_interface, rendezvous_error
from shmtrain.fabric.shm.control import ControlBlock, PeerFailure, alive, first_line
from shmtrain.fabric.shm.host import HostGroup
from shmtrain.fabric.shm.segment import SharedSegment
from shmtrain.fabric.trust import check_path
from shmtrain.startup import mark

DEFAULT_TIMEOUT_S = 120.0


@dataclass
class ProcessContext:
    """This worker's place in the job and its handles on the fabric."""

    rank: int
    world_size: int
    local_rank: int
    local_world: int
    node_rank: int
    num_nodes: int
    run_id: str
    store: dist.Store
    host: HostGroup
    timeout: float
    leaders: dist.ProcessGroup | None = None
    #: whether this context created the default process group (False: the caller's script
    #: had called ``init_process_group`` first, and :meth:`close` leaves it to the caller)
    owns_group: bool = True
    #: this host was lost and started again while the job ran: no job-wide gloo groups
    #: (no default process group, no leaders' group), see the module docstring
    rejoined: bool = False
    _closed: bool = field(default=False, repr=False)

    @property
    def is_leader(self) -> bool:
        """True for local rank 0, which speaks for its host across hosts."""
        return self.local_rank == 0

    def fail(self, code: int = 1) -> None:
        """Tell the host's peers this worker failed, so they raise instead of waiting."""
        self.host.control.abort(self.local_rank, code)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Leave the job in order after a normal end: once every peer has got here (a
        gloo barrier, skipped when a local peer is known dead or the host aborted, and
        bounded by ``timeout``), destroy the process groups. Nobody then tears down its
        gloo pairs while a peer still uses them (a peer's gloo thread meeting a closed
        connection at exit can abort the process: "terminate called without an active
        exception")."""
        if self._closed:
            return
        control = self.host.control
        healthy = control.aborted() is None and all(
            alive(control.pid(r)) for r in range(self.local_world) if r != self.local_rank
        )
        if healthy and dist.is_initialized() and dist.get_world_size() > 1:
            try:
                dist.monitored_barrier(timeout=timedelta(seconds=timeout))
            except Exception:  # noqa: BLE001 - a peer gone at the end: just tear down
                pass
        self.close()

    def take_over(self, successor: ProcessContext) -> None:
        """Become ``successor`` (the context of the job's next generation, after a peer
        was replaced in place: ``runtime/run/recovery.py``), so that whoever holds this
        object (the worker's entry point, which shuts it down at the end) holds that one."""
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(successor, name))

    def close(self) -> None:
        """Destroy the process groups this context created (at once; see :meth:`shutdown`
        for the orderly way). A default group the caller created before :func:`from_env`
        stays (the caller's ``dist.destroy_process_group()`` ends it); the hosts' leaders'
        group, which this context made, is destroyed either way."""
        if not self._closed:
            self._closed = True
            if not dist.is_initialized():
                return
            if self.owns_group:
                dist.destroy_process_group()
            elif self.leaders is not None:
                dist.destroy_process_group(self.leaders)


#: the environment variable with the generation of a local job: 0 at its start, one more
#: each time its workers form the job again around a replaced worker (``runtime/run/recovery.py``)
GENERATION_ENV = "SHMTRAIN_GENERATION"


def generation_store(store: dist.Store, generation: int) -> dist.Store:
    """The keys of ``generation`` of a local job's FileStore (generation 0: the store)."""
    return dist.PrefixStore(f"g{generation}/", store) if generation else store


def local_store(timeout: float) -> dist.Store:
    """The store of a local launch's job as this worker's environment names it (its
    FileStore, under the keys of its generation)."""
    return _open_store("127.0.0.1", 0, 1, timeout)


def under_torchrun() -> bool:
    """True when torchrun (or another launcher with its environment) started this process:
    it is a worker itself, with no workers of its own to fork."""
    return "SHMTRAIN_JOB_DIR" not in os.environ and (
        "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
    )


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None


def from_env(timeout: float = DEFAULT_TIMEOUT_S) -> ProcessContext:
    """Join the job described by the environment (torchrun's, or shmtrain's launcher's).

    With no such environment this is a job of one process.
    """
    rank = env_int("RANK", 0)
    world = env_int("WORLD_SIZE", 1)
    local_rank = env_int("LOCAL_RANK", rank)
    local_world = env_int("LOCAL_WORLD_SIZE", world)
    if world % local_world:
        raise ValueError(
            f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}: every "
            "host must run the same number of workers"
        )
    num_nodes = world // local_world
    node_rank = env_int("GROUP_RANK", rank // local_world)
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    _choose_gloo_interface(addr, world, local_rank)
    store = _open_store(addr, rank, world, timeout)
    mark("store")
    run_id = hosts.run_id(store, rank)
    start = _host_start(store, node_rank, local_rank, num_nodes)
    if start > 1:
        _check_running(store, node_rank, addr)
    host = _host_group(store, node_rank, local_rank, local_world, run_id, timeout, start)
    host.barrier("the host's set-up")  # a peer dead before gloo's rendezvous is seen here, not at its timeout
    mark("host")
    owns_group = not dist.is_initialized()
    leaders = None if start > 1 else _join_groups(store, rank, world, local_world, num_nodes, timeout)
    mark("gloo")
    host.barrier("set-up")
    return ProcessContext(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world=local_world,
        node_rank=node_rank,
        num_nodes=num_nodes,
        run_id=run_id,
        store=store,
        host=host,
        timeout=timeout,
        leaders=leaders,
        owns_group=owns_group,
        rejoined=start > 1,
    )


def _host_start(store: dist.Store, node_rank: int, local_rank: int, num_nodes: int) -> int:
    """Which start of this host's node slot in this job this is (1: the first; more: the
    host was lost and started again). Local rank 0 counts the start in
    the job's store; the host's other workers read the count under their torchrun
    agent's identity (host name and pid: one agent per start of a host). Outside a
    torchrun job across hosts there is one start."""
    if num_nodes == 1 or not os.environ.get("TORCHELASTIC_RUN_ID"):
        return 1
    key = f"node{node_rank}/start/{socket.gethostname()}:{os.getppid()}"
    if local_rank == 0:
        store.set(key, str(store.add(f"node{node_rank}/starts", 1)))
    return int(store.get(key))


def _check_running(store: dist.Store, node_rank: int, addr: str) -> None:
    """A rejoining host needs a job still training: refuse one that has ended."""
    if store.check(["results/done"]):
        raise PeerFailure(
            f"host {node_rank} started again after the job at {addr} had ended (its results are "
            "collected): there is nothing to rejoin; start a new run (or `shmtrain train --resume` "
            "from its checkpoint)")


def _choose_gloo_interface(addr: str, world: int, local_rank: int) -> None:
    """Keep gloo on loopback for a job on loopback; else say which interface it uses."""
    if addr in ("127.0.0.1", "localhost", "::1") and "GLOO_SOCKET_IFNAME" not in os.environ:
        # A job on loopback: keep gloo there too instead of resolving the host name.
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    elif world > 1:
        chosen = choose_interface(addr)  # not the host name's address (often 127.0.1.1)
        if chosen is not None and local_rank == 0:
            print(f"shmtrain: gloo uses interface {chosen[0]} ({chosen[1]}), the one that routes to "
                  f"MASTER_ADDR {addr}; set GLOO_SOCKET_IFNAME to choose another", file=sys.stderr, flush=True)


def _open_store(addr: str, rank: int, world: int, timeout: float) -> dist.Store:
    """The job's store: shmtrain's launcher's (a FileStore in its private folder, or a
    TCPStore on loopback), torchrun's (per restart attempt), the caller's default process
    group's when it made one outside torchrun, or one in this process for a job of one."""
    wait = timedelta(seconds=timeout)
    store_file = os.environ.get("SHMTRAIN_STORE_FILE")
    if store_file:
        check_path(os.path.dirname(store_file), "the job's folder", "it is not the one this run's launcher made",
                   private=True)
        store: dist.Store = dist.FileStore(store_file, -1)
        store.set_timeout(wait)
        generation = env_int(GENERATION_ENV, 0)  # a job formed again around a replaced worker
        return generation_store(store, generation)
    store_port = env_int("SHMTRAIN_STORE_PORT", 0)
    port = store_port or env_int("MASTER_PORT", 29500)
    if not store_port and world > 1 and dist.is_initialized() and not os.environ.get("TORCHELASTIC_RUN_ID"):
        # the caller's process group, made outside torchrun (Lightning's launcher, mp.spawn): its
        # rank 0 already serves the store on MASTER_PORT, where a second server could not bind
        return dist.PrefixStore("shmtrain/", dist.distributed_c10d._get_default_store())
    try:
        if store_port:
            store = dist.TCPStore(addr, store_port, world, is_master=False, timeout=wait)
        elif world > 1:
            agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
            base = dist.TCPStore(addr, port, world, is_master=rank == 0 and not agent, timeout=wait)
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"shmtrain/{attempt}/", base)
        else:
            store = dist.HashStore()
    except (RuntimeError, OSError) as exc:  # DistNetworkError / DistStoreError are RuntimeErrors
        raise rendezvous_error(exc, addr, port, timeout, rank) from None
    return store


def _host_group(store: dist.Store, node_rank: int, local_rank: int, local_world: int, run_id: str,
                timeout: float, start: int = 1) -> HostGroup:
    """This host's workers, on the launcher's control block when it made one; a host
    started again (``start`` > 1) under keys and segment names of its own (the lost
    start's keys are still in the store)."""
    tag = f"{node_rank}" if start == 1 else f"{node_rank}s{start}"
    control = None
    control_name = os.environ.get("SHMTRAIN_CONTROL")
    if control_name:
        fd = os.environ.get("SHMTRAIN_CONTROL_FD")
        segment = SharedSegment(control_name, ControlBlock.nbytes(local_world), create=False,
                                fd=int(fd) if fd else None)
        control = ControlBlock(segment, local_world, init=False)
    return hosts.form_host(store, tag, local_rank, local_world, run_id, timeout, control=control)


def _join_groups(store: dist.Store, rank: int, world: int, local_world: int, num_nodes: int,
                 timeout: float) -> dist.ProcessGroup | None:
    """Join the job's gloo process group (unless already in one); the hosts' leaders'
    group when the job spans hosts (else None)."""
    wait = timedelta(seconds=timeout)
    try:
        if not dist.is_initialized():
            dist.init_process_group(
                "gloo", store=dist.PrefixStore("pg/", store), rank=rank, world_size=world, timeout=wait
            )
        leaders = hosts.form_leaders(local_world, world, timeout)
    except RuntimeError as exc:  # a peer's gloo address unreachable, or a peer that never came
        ifname = os.environ.get("GLOO_SOCKET_IFNAME", "(unset)")
        raise PeerFailure(
            f"rank {rank} could not connect to the other workers' gloo sockets within {timeout:.0f} s "
            f"({first_line(exc, 160)}); "
            f"GLOO_SOCKET_IFNAME={ifname}: every host must reach the others on that interface (set it to "
            "the interface on the hosts' shared network)") from None
    return leaders
