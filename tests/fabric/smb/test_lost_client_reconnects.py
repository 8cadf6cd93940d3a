"""A lost client of the memory server connects again and goes on (the server's part).

A stand-alone ``shmtrain smb-server --clients 2`` and two client processes on loopback:
client 0 accumulates e_0 into a global buffer without stopping; client 1 accumulates
e_1, is killed (SIGKILL) mid-run, and 5 s later the same command starts it again. It
connects again under the same rank, finds its buffers by name, reads the global buffer
as it is now (its earlier increments included, not zeros and not a file) and its
iterations from the board (its TERM counter), and trains to its target; client 0 never
stops and sees it lost, then alive again. Every increment is counted exactly: the
global buffer ends as (client 0's count, client 1's target), client 1's count off by
at most the one accumulate in flight when it was killed.
"""

from __future__ import annotations

import datetime
import json
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from shmtrain.fabric.shm.control import PeerFailure
from shmtrain.fabric.smb.api import STATE_DONE, STATE_TRAINING
from shmtrain.fabric.smb.remote import RemoteBufferService
from shmtrain.fabric.smb.wire import unseal
from support.memory_server import finish_server, start_server

pytestmark = pytest.mark.timeout(120)

TARGET = 300


def client(address: str, rank: int) -> None:
    """One client (the same command for a first start and for a rejoin); prints its record."""
    service = RemoteBufferService(address, rank, 2, timeout=30)
    handles = {}
    for name in ("global", f"inc.{rank}"):
        try:
            handles[name], again = service.attach(service.create(name, 2)), False
        except ValueError:  # already there: this rank was here before, or rank 0 made it
            handles[name], again = service.attach(service.lookup(name)), True
    total, mine = handles["global"], handles[f"inc.{rank}"]
    service.write(mine, torch.nn.functional.one_hot(torch.tensor(rank), 2).float())
    board = service.board
    start = board.progress(rank)  # the TERM counter the board kept for this rank
    record = {"rank": rank, "again": again, "start": start, "pulled": service.read(total, torch.zeros(2)).tolist()}
    done, alive, deadline = start, [], time.monotonic() + 90
    while time.monotonic() < deadline:
        if rank == 1 and done >= TARGET or rank == 0 and board.state(1) == STATE_DONE:
            break
        service.wait(service.accumulate(mine, total))
        done += 1
        board.set_progress(done, STATE_TRAINING)
        if rank == 0 and (not alive or alive[-1][0] != board.alive(1)):
            alive.append((board.alive(1), done))  # when client 1 was seen (not) alive
        time.sleep(0.004)
    board.set_progress(done, STATE_DONE)
    record.update(count=done, alive=alive, final=service.read(total, torch.zeros(2)).tolist())
    service.close()
    print(json.dumps(record), flush=True)


def _start(address: str, rank: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, address, str(rank)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _board(store: dist.Store, key: str) -> str | None:
    if not store.check([key]):
        return None
    opened = unseal(None, "", key, store.get(key).decode())
    return None if opened is None else opened[0]


def test_a_lost_client_connects_again_and_goes_on_from_the_server() -> None:
    proc, address = start_server(2)
    clients = []
    try:
        clients = [_start(address, 0), _start(address, 1)]
        host, _, port = address.rpartition(":")
        store = dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=10))
        deadline = time.monotonic() + 60
        while int((_board(store, "smb/progress/1") or "0,0").split(",")[0]) < 60:  # client 1 trains
            assert time.monotonic() < deadline and clients[1].poll() is None, clients[1].stderr.read()
            time.sleep(0.02)
        clients[1].send_signal(signal.SIGKILL)
        clients[1].wait(10)
        while _board(store, "smb/dead/1") != "1":  # the server saw it lost
            assert time.monotonic() < deadline, "the server never marked client 1 lost"
            time.sleep(0.02)
        time.sleep(5)  # then the same command again
        clients.append(_start(address, 1))
        outputs = [clients[0].communicate(timeout=60), clients[2].communicate(timeout=60)]
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
                c.communicate()
        code, out, err = finish_server(proc)
    assert clients[0].returncode == 0 and clients[2].returncode == 0, outputs
    first, again = (json.loads(o[0].strip().splitlines()[-1]) for o in outputs)
    assert again["again"] and again["start"] >= 60, again  # its TERM counter, from the board
    assert again["pulled"][1] >= again["start"] and again["pulled"][0] > 0, again  # the global buffer as it is
    seen = first["alive"]  # client 0 trained on through the loss and saw client 1 back
    assert [a for a, _ in seen] == [True, False, True], seen
    assert seen[2][1] - seen[1][1] >= 100, seen  # >= 100 accumulates while client 1 was away (5 s)
    assert first["final"][0] == first["count"], first
    assert again["count"] == TARGET and 0 <= first["final"][1] - TARGET <= 1, (first, again)
    assert "client 1 lost (its link closed" in err and "client 1 (announced address 127.0.0.1) connected again" in err
    assert code == 0 and "0 clients lost, 1 connections again after a loss" in out, out + err


def test_a_rank_still_connected_is_refused_naming_it_and_one_that_left_connects_at_once() -> None:
    """The server serves one connection per rank: a second start of a rank whose earlier
    process still trains (its host was not lost) waits for that loss, then is refused
    with a line saying what to end; after the earlier one's goodbye it connects at once."""
    proc, address = start_server(2)
    try:
        first = RemoteBufferService(address, 1, 2, timeout=30)
        first.board.set_progress(5, STATE_TRAINING)
        start = time.monotonic()
        with pytest.raises(PeerFailure, match="rank 1 is still connected to the memory server .* end every "
                                              "process of this host's earlier start"):
            RemoteBufferService(address, 1, 2, timeout=2)
        assert time.monotonic() - start < 10
        first.close()
        start = time.monotonic()
        again = RemoteBufferService(address, 1, 2, timeout=30)
        assert time.monotonic() - start < 5 and again.board.progress(1) == 5  # its TERM counter kept
        again.close()
        RemoteBufferService(address, 0, 2, timeout=30).close()
    finally:
        code, out, err = finish_server(proc)
    assert code == 0, out + err


if __name__ == "__main__":
    client(sys.argv[1], int(sys.argv[2]))
