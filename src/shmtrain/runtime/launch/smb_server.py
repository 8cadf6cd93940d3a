"""``shmtrain smb-server``: a stand-alone memory server (SMB-REMOTE, ShmCaffe III-B, Fig. 7).

Runs :class:`shmtrain.fabric.smb.server.MemoryServer` until every client of the job has
come and said goodbye or been lost (a lost one may connect again meanwhile), writing
the global buffers to ``--out`` every ``--snapshot-every`` seconds (atomically);
``--resume FILE`` starts from such a snapshot. SIGINT/SIGTERM write a last
snapshot (when snapshots are on) and end the server; its clients then fail with an
error naming it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

SNAPSHOT = "smb-snapshot.pt"
#: the process name of a memory server forked by a worker (``prefork``)
SERVER_NAME = b"shmtrain-smb"


def _handler(args: argparse.Namespace) -> int:
    if args.idle_exit < 0:
        raise ValueError(f"--idle-exit {args.idle_exit}: seconds must be >= 0 (0: never)")
    if args.snapshot_every < 0:
        raise ValueError(f"--snapshot-every {args.snapshot_every}: seconds must be >= 0 (0: no snapshots)")
    if args.resume and not Path(args.resume).is_file():
        raise ValueError(f"--resume {args.resume}: no such snapshot file (the server writes {SNAPSHOT} in --out)")
    from shmtrain.fabric.smb.remote import read_secret  # torch: after the checks that need none
    from shmtrain.fabric.smb.server import MemoryServer
    from shmtrain.fabric.trust import write_private

    secret = read_secret(args.secret_file)
    out = Path(args.out)
    if args.snapshot_every:
        out.mkdir(parents=True, exist_ok=True)
    server = MemoryServer(args.clients, bind=args.bind, port=args.port, secret=secret, timeout=args.timeout,
                          log=lambda line: print(line, file=sys.stderr, flush=True), resume=args.resume)
    if args.address_file:  # mode 0600, written whole, then renamed: a reader never sees half of it
        write_private(Path(args.address_file), server.address.encode())
    print(f"shmtrain smb-server: serving up to {args.clients} workers at {server.address}"
          f"{' (shared secret required)' if secret else ''}; clients: shmtrain train --smb-server {server.address}",
          flush=True)
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            server.serve()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failure.append(exc)

    thread = threading.Thread(target=serve, name="smb-serve", daemon=True)
    stopping: list[int] = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda s, _f: stopping.append(s))
    thread.start()
    last = time.monotonic()
    snapshot = out / SNAPSHOT
    idle = False
    while thread.is_alive() and not stopping:
        thread.join(0.2)
        server.reap()  # payloads that arrived, clients lost while the server waits for requests
        if server.finished:
            break
        if args.idle_exit and time.monotonic() - server.last_request > args.idle_exit:
            idle = True
            print(f"shmtrain smb-server: no request for {args.idle_exit:.0f} s "
                  f"({server.remaining} clients never said goodbye); stopping", flush=True)
            break
        if args.snapshot_every and time.monotonic() - last >= args.snapshot_every:
            server.snapshot(snapshot)
            last = time.monotonic()
    if args.snapshot_every:
        server.snapshot(snapshot)
        print(f"shmtrain smb-server: buffers written to {snapshot}", flush=True)
    server.audit(every=0)  # what parties without the secret left in the store, to the end
    print(f"shmtrain smb-server: {server.applied} accumulations applied, {server.refused} requests refused, "
          f"{server.errors} errors, {len(server.lost)} clients lost"
          + (f" (ranks {', '.join(map(str, sorted(server.lost)))})" if server.lost else "")
          + f", {server.returned} connections again after a loss", flush=True)
    clean = server.finished and not (stopping or idle or failure or server.errors or server.refused
                                     or server.lost or server.returned)
    if args.address_file:  # its starter read it; else no one will
        Path(args.address_file).unlink(missing_ok=True)
    if clean and args.log_file:
        Path(args.log_file).unlink(missing_ok=True)  # nothing to tell: leave no file behind
        if args.private_dir:  # the folder its starter made for both, if nothing else is in it
            with contextlib.suppress(OSError):
                os.rmdir(args.private_dir)
    if stopping or idle or thread.is_alive() or server.watching:  # a thread may be blocked in gloo
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + stopping[0] if stopping else 3 if idle else 0)
    if failure:
        raise failure[0]
    return 0


def wanted(config: Any) -> bool:
    """Whether this torchrun worker is the rank 0 that will start the job's memory server:
    an asynchronous strategy on the buffer service, hosts > 1, no ``--smb-server``."""
    from shmtrain import strategies
    from shmtrain.strategies.elastic.shared_weights import SharedWeightsStrategy

    world = int(os.environ.get("WORLD_SIZE", "1"))
    hosts = world // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))
    return (os.environ.get("RANK", "0") == "0" and hosts > 1
            and issubclass(strategies.get(config.strategy), SharedWeightsStrategy)
            and not getattr(config.strategy_config, "smb_server", ""))


def prefork(world: int, timeout: float) -> None:
    """Fork the job's memory server now, from a worker that has imported torch and started
    no thread yet (the zygote's rule, ``runtime/launch/zygote.py``), so the server does not start
    a new interpreter and import torch again once the job has joined (``start_memory_server``
    takes it from ``job_server.PREFORKED``). Its files (address, log) live in a new private
    directory (``job_server.server_files``). Does nothing when a thread is running already."""
    import secrets

    from shmtrain.fabric.smb import job_server

    if threading.active_count() > 1:
        return
    secret = secrets.token_hex(32)
    folder = job_server.server_files()
    argv = job_server.server_argv(world, timeout, folder)
    pid = os.fork()
    if pid:
        job_server.PREFORKED = job_server.Preforked(pid, folder, secret, world)
        return
    code = 1
    try:  # the child: the server, in its own session (it outlives rank 0), its output in the log
        os.setsid()
        from shmtrain.runtime.launch.zygote import name_process

        name_process(SERVER_NAME)  # found by name: its command line is the worker's
        sink = os.open(folder / job_server.LOG, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(sink, 1)
        os.dup2(sink, 2)
        os.environ[job_server.SECRET_ENV] = secret
        parser = argparse.ArgumentParser(prog="shmtrain")
        add_parser(parser.add_subparsers())
        code = _handler(parser.parse_args(["smb-server", *argv]))
    except BaseException as exc:  # noqa: BLE001 - the child never returns into the worker
        print(f"shmtrain smb-server: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "smb-server", help="run a memory server for workers on several hosts (SMB-REMOTE)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, required=True,
                   help="the most workers it serves (all hosts together; ranks 0 to N-1, which may come and go)")
    p.add_argument("--bind", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; any other needs a shared secret)")
    p.add_argument("--port", type=int, default=29600, help="port of the server (default 29600; 0: any free one)")
    p.add_argument("--secret-file", help="file holding the shared secret (or set SHMTRAIN_SECRET)")
    p.add_argument("--snapshot-every", type=float, default=0.0,
                   help="write the buffers to OUT/smb-snapshot.pt every this many seconds (default 0: never)")
    p.add_argument("--out", default="smb-server", help="folder of the snapshots (default ./smb-server)")
    p.add_argument("--resume", help="start the buffers from this snapshot file")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds to wait for the clients to connect, and for each transfer (default 120)")
    p.add_argument("--idle-exit", type=float, default=0.0,
                   help="stop after this many seconds without any request (default 0: never; the server "
                        "that `shmtrain train` starts for a multi-host job uses its --timeout)")
    p.add_argument("--address-file", help=argparse.SUPPRESS)  # where a starter reads HOST:PORT
    p.add_argument("--log-file", help=argparse.SUPPRESS)  # the starter's log of this server: removed on a clean end
    p.add_argument("--private-dir", help=argparse.SUPPRESS)  # the starter's private folder of both: removed with it
    p.set_defaults(handler=_handler)
