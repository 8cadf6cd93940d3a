"""Multi-host start-up that just works: which interface gloo uses, and clear failures.

A new user's first two-host job used to go wrong in two ways: gloo
bound to 127.0.0.1 because the host name resolved to localhost, so host 0 failed at
once with a raw gloo traceback; and host 1 then waited torch's default 10 minutes. So:

* :func:`choose_interface`: when ``GLOO_SOCKET_IFNAME`` is unset, gloo is pointed at the
  interface whose address routes to ``MASTER_ADDR`` (the kernel's own routing decision,
  read from a connected UDP socket: no packet is sent), and the choice is logged;
* every rendezvous and process group obeys ``--timeout``;
* :func:`rendezvous_error` turns a failed connection into one line naming the address
  and the fix.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct

from shmtrain.fabric.shm.control import first_line

_SIOCGIFADDR = 0x8915


def interface_addresses() -> dict[str, str]:
    """IPv4 address of every interface that has one (Linux ``SIOCGIFADDR``)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def route_source(peer: str) -> str:
    """This host's address on the route to ``peer`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(peer), 9))
        return probe.getsockname()[0]


def choose_interface(master_addr: str) -> tuple[str, str] | None:
    """Set ``GLOO_SOCKET_IFNAME`` to the interface that routes to ``master_addr`` when the
    user has not chosen one; returns ``(interface, address)`` when it chose, else None."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    try:
        source = route_source(master_addr)
    except OSError:
        return None  # unresolvable or unroutable: the rendezvous error will say so
    for name, address in interface_addresses().items():
        if address == source:
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return name, address
    return None


def rendezvous_error(exc: BaseException, addr: str, port: int, timeout: float, rank: int) -> ValueError:
    """One line for a rendezvous that failed: the address, what happened and the fix."""
    text = first_line(exc, 160)
    if rank == 0:
        fix = (f"rank 0 listens there: is {addr} an address of this host, and port {port} free? "
               "(set MASTER_ADDR/--master-addr to this host's address and MASTER_PORT to a free port)")
    else:
        fix = (f"is node 0 started, is {addr} reachable from this host and port {port} open? "
               f"(MASTER_ADDR must be node 0's address as this host sees it; --timeout {timeout:.0f} s)")
    return ValueError(f"cannot join the job's rendezvous at {addr}:{port}: {text}; {fix}")
