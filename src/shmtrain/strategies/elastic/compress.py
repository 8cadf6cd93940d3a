"""``--compress`` for the elastic strategies (EASGD, SEASGD, HSGD): which worker
exchanges compressed differences with the memory server, and its part of a checkpoint.

Only a worker across a link from the memory server compresses
(:class:`~shmtrain.fabric.smb.compressed.CompressedGlobal`: C(dW_x + e_x) up, a compressed
difference against its mirror of W_g down); the workers on the server's own host, and
every worker of a one-host job (shared memory), exchange whole weights as without
``--compress``. Across the link means: the job's own memory server (started next to
global rank 0) and a worker of another host than rank 0's; or a ``--smb-server`` whose
address is not one of this host's.
"""

from __future__ import annotations

import sys
from typing import Any

from shmtrain.fabric.compress.codec import parse_compress
from shmtrain.fabric.smb import Buffer, BufferService
from shmtrain.fabric.smb.remote import RemoteBufferService
from shmtrain.fabric.smb.wire import is_loopback, route_address
from shmtrain.fabric.transports import Transports


def server_on_this_host(address: str) -> bool:
    """Whether the memory server at ``HOST:PORT`` listens on an address of this host (the
    route to it leaves from that same address, or it is loopback)."""
    host = address.rpartition(":")[0]
    if is_loopback(host):
        return True
    try:
        return route_address(host) == host
    except (OSError, ValueError, RuntimeError):
        return False


def across_link(config: Any, ctx: Any) -> bool:
    """Whether this worker's memory server is on another host (see the module's docstring)."""
    if getattr(config, "smb_server", ""):
        return not server_on_this_host(config.smb_server)
    return getattr(ctx, "num_nodes", 1) > 1 and getattr(ctx, "node_rank", 0) != 0


def open_compressed(config: Any, ctx: Any, transports: Transports, service: BufferService,
                    global_weights: Buffer, increment: Buffer | None) -> Any:
    """This worker's compressed view of W_g, or None (no ``--compress``, a worker that
    does not exchange with W_g, or a server on this host)."""
    spec = parse_compress(getattr(config, "compress", ""))
    if spec is None or increment is None or not isinstance(service, RemoteBufferService):
        return None
    if not across_link(config, ctx):
        return None
    compressed = transports.compressed_global(service, global_weights, spec)
    print(f"shmtrain: rank {service.rank} exchanges with the memory server across the link compressed "
          f"(--compress {spec.text()}: {compressed.codec.nbytes} bytes each way per exchange instead of "
          f"{4 * global_weights.numel})", file=sys.stderr, flush=True)
    return compressed


def load_compress(text: str, compressed: Any, saved: dict[str, Any] | None) -> None:
    """Check a checkpoint's ``compress`` entry against this run's ``--compress`` (refused by
    name when they differ) and restore the error feedback of a worker across the link
    (its mirror is not restored: its first read after the resume is a dense one)."""
    spec = parse_compress(text)
    mine = spec.text() if spec is not None else None
    theirs = saved.get("spec") if saved is not None else None
    if mine != theirs:
        raise ValueError(
            f"the checkpoint was written with {'--compress ' + str(theirs) if theirs else 'no --compress'}, this "
            f"run has {'--compress ' + mine if mine else 'none'}: resume with the --compress the checkpoint was "
            "written with (the error feedback of the workers across the link is part of the state)")
    if compressed is None:
        return
    if saved is None or "error" not in saved:
        raise ValueError(f"--compress {mine}: this rank exchanges across the link, but its checkpoint holds no error "
                         "feedback (it was written by a rank on the memory server's host); resume with the hosts "
                         "the checkpoint was written with")
    compressed.load_state_dict(saved)
