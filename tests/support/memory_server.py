"""The memory server (SMB-REMOTE) as a test meets it: a stand-alone ``shmtrain
smb-server`` started on a free loopback port and ended with its output, and the servers
running on this machine (a job's own, forked by its rank 0, included)."""

from __future__ import annotations

import subprocess
import sys

from support.torchrun import free_port


def start_server(clients: int, *extra: str, env: dict[str, str] | None = None,
                 port: int | None = None) -> tuple[subprocess.Popen, str]:
    """``shmtrain smb-server --clients CLIENTS EXTRA`` on a free port of 127.0.0.1 (or
    ``port``), once it says it is serving: the process and its ``host:port``."""
    port = free_port() if port is None else port
    proc = subprocess.Popen([sys.executable, "-m", "shmtrain", "smb-server", "--clients", str(clients),
                             "--port", str(port), "--timeout", "60", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    first = proc.stdout.readline()
    assert "serving" in first, first + proc.stderr.read()
    return proc, f"127.0.0.1:{port}"


def finish_server(proc: subprocess.Popen, wait: float = 60) -> tuple[int, str, str]:
    """The server's exit status and output; killed when it has not ended within ``wait``
    (a failed test's clients never said goodbye)."""
    if sys.exc_info()[0] is not None:
        wait = 1
    try:
        out, err = proc.communicate(timeout=wait)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err


def running_servers() -> list[int]:
    """The pids of the memory servers on this machine: started as a command (with an
    address file), or forked by a job's rank 0 (``runtime/launch/smb_server.py``: named
    ``shmtrain-smb``)."""
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline", "name"]):
        cmdline = process.info["cmdline"] or []
        if ("smb-server" in cmdline and "--address-file" in cmdline) or process.info["name"] == "shmtrain-smb":
            found.append(process.pid)
    return found
