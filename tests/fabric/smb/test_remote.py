"""SMB-REMOTE: the memory server and its client behind the SMB API.

A stand-alone ``shmtrain smb-server`` process and workers launched as a job: exact
accumulations from every worker, read/write round trips, the shared secret (missing,
wrong, right), a malformed and a truncated request answered while the server goes on
serving, snapshots and ``--resume``, and clear errors for bad options.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shmtrain.fabric.smb.remote import RemoteBufferService
from shmtrain.fabric.smb.wire import OP_ACCUMULATE
from shmtrain.runtime.launch.launcher import launch
from support.memory_server import finish_server, running_servers, start_server
from support.torchrun import free_port

pytestmark = pytest.mark.timeout(120)


def accumulate_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    secret = payload.get("secret")
    service = RemoteBufferService(payload["address"], ctx.rank, ctx.world_size, timeout=30,
                                  secret=secret.encode() if secret else None)
    numel = payload["numel"]
    if ctx.rank == 0:
        total = service.attach(service.create("global", numel))
        service.write(total, torch.full((numel,), 0.5))
    mine = service.attach(service.create(f"inc.{ctx.rank}", numel))
    if ctx.rank != 0:
        total = service.attach(service.lookup("global"))
    service.ready()
    for _ in range(payload["steps"]):
        service.write(mine, torch.full((numel,), float(ctx.rank + 1)))
        ticket = service.accumulate(mine, total)
        service.wait(ticket)
        assert service.done(ticket)
    service.board.set_progress(payload["steps"], 2)
    dist.barrier()
    result = service.read(total, torch.empty(numel))
    progress = [service.board.progress(r) for r in range(ctx.world_size)]
    service.close()
    return {"first": float(result[0]), "last": float(result[-1]), "progress": progress}


def test_every_accumulation_applied_exactly_once(tmp_path: Path) -> None:
    proc, address = start_server(3, "--snapshot-every", "0.5", "--out", str(tmp_path))
    try:
        results = launch("fabric.smb.test_remote:accumulate_worker", 3,
                         {"address": address, "numel": 300_001, "steps": 5})
    finally:
        code, out, err = finish_server(proc)
    expected = 0.5 + 5 * (1 + 2 + 3)
    assert all(r["first"] == expected and r["last"] == expected for r in results)
    assert all(r["progress"] == [5, 5, 5] for r in results)
    assert code == 0 and "15 accumulations applied, 0 requests refused, 0 errors" in out, out + err
    snapshot = torch.load(tmp_path / "smb-snapshot.pt", weights_only=True)
    assert snapshot["applied"] == 15 and len(snapshot["buffers"]) == 4


def stress_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    service = RemoteBufferService(payload["address"], ctx.rank, ctx.world_size, timeout=60)
    world = ctx.world_size
    if ctx.rank == 0:
        total = service.attach(service.create("counts", world))
        service.write(total, torch.zeros(world))
    mine = service.attach(service.create(f"one.{ctx.rank}", world))
    service.write(mine, torch.nn.functional.one_hot(torch.tensor(ctx.rank), world).float())
    if ctx.rank != 0:
        total = service.attach(service.lookup("counts"))
    service.ready()
    tickets = []
    for step in range(payload["steps"]):
        tickets.append(service.accumulate(mine, total))  # several in flight
        if step % 16 == 15:
            service.wait(tickets[-1])
    service.wait(tickets[-1])
    assert all(service.done(t) for t in tickets)
    dist.barrier()
    counts = service.read(total, torch.empty(world))
    service.close()
    return {"counts": counts.tolist()}


@pytest.mark.timeout(240)
def test_eight_remote_clients_accumulating_lose_and_double_nothing() -> None:
    """The stress: 8 clients, 1,000 accumulations each, concurrently. Client r adds
    the one-hot vector e_r, so a lost or doubled increment shows in its own count."""
    proc, address = start_server(8)
    try:
        results = launch("fabric.smb.test_remote:stress_worker", 8, {"address": address, "steps": 1000}, timeout=200)
    finally:
        code, out, err = finish_server(proc)
    assert all(r["counts"] == [1000.0] * 8 for r in results), results[0]
    assert code == 0 and "8000 accumulations applied, 0 requests refused, 0 errors" in out, out + err


def test_resume_from_a_snapshot_keeps_the_buffers(tmp_path: Path) -> None:
    proc, address = start_server(2, "--snapshot-every", "30", "--out", str(tmp_path))
    try:
        launch("fabric.smb.test_remote:accumulate_worker", 2, {"address": address, "numel": 10, "steps": 1})
    finally:
        finish_server(proc)
    proc, address = start_server(2, "--resume", str(tmp_path / "smb-snapshot.pt"))
    try:
        results = launch("fabric.smb.test_remote:resumed_worker", 2, {"address": address})
    finally:
        code, out, _ = finish_server(proc)
    assert results == [0.5 + 3.0 + 3.0] * 2 and code == 0


def resumed_worker(ctx, payload: dict[str, Any]) -> float:
    service = RemoteBufferService(payload["address"], ctx.rank, ctx.world_size, timeout=30)
    total = service.attach(service.lookup("global"))
    mine = service.attach(service.lookup(f"inc.{ctx.rank}"))
    service.ready()
    service.wait(service.accumulate(mine, total))  # the increments survived too
    dist.barrier()
    value = float(service.read(total, torch.empty(10))[0])
    service.close()
    return value


def secret_worker(ctx, payload: dict[str, Any]) -> str:
    secret = {0: b"right-secret", 1: b"wrong-secret", 2: None, 3: b"never-proven"}[ctx.rank]
    if ctx.rank == 3:  # a client that skips the proof and goes straight to a write
        RemoteBufferService._hello = lambda self, secret, nonce: None
    try:
        service = RemoteBufferService(payload["address"], ctx.rank, ctx.world_size, timeout=30, secret=secret)
    except PermissionError as exc:  # ranks 1 and 2: refused at the greeting, or no secret at all
        return f"PermissionError: {exc}"
    outcome = "ok"
    try:
        key = service.create(f"b{ctx.rank}", 4)
        buffer = service.attach(key)
        service.write(buffer, torch.ones(4))
        outcome = f"ok {service.read(buffer, torch.zeros(4)).tolist()}"
    except PermissionError as exc:
        outcome = f"PermissionError: {exc}"
    service.close()
    return outcome


def test_a_client_without_the_secret_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text("right-secret\n")
    proc, address = start_server(4, "--secret-file", str(secret_file))
    try:
        results = launch("fabric.smb.test_remote:secret_worker", 4, {"address": address}, timeout=60)
    finally:
        code, out, err = finish_server(proc)
    assert results[0] == "ok [1.0, 1.0, 1.0, 1.0]"
    assert results[1].startswith("PermissionError") and "refused" in results[1]
    assert results[2].startswith("PermissionError") and "requires a shared secret" in results[2]
    assert results[3].startswith("PermissionError") and "has not proven the shared secret" in results[3]
    assert "client 1 (announced address 127.0.0.1) refused: its proof of the shared secret is wrong" in err
    assert "client 3 (announced address 127.0.0.1) refused create of 'b3': it has not proven the shared secret" in err
    assert "refused store entry smb/progress/3 = " in err  # its board entry, sealed with its wrong secret
    assert code == 0 and "0 accumulations applied, 3 requests refused" in out, out + err


def hostile_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    """Ranks 0 and 1 prove the secret; rank 2 is a hostile client: it never proves
    it and attacks through the job's key store (the old protocol's buffer names, ids and
    liveness marks, and board entries sealed with a guessed secret) and on the link."""
    import datetime

    from shmtrain.fabric.smb.api import BufferKey
    from shmtrain.fabric.smb.wire import seal

    if ctx.rank == 2:
        RemoteBufferService._hello = lambda self, secret, nonce: None
    secret = b"guessed" if ctx.rank == 2 else b"right-secret"
    service = RemoteBufferService(payload["address"], ctx.rank, ctx.world_size, timeout=30, secret=secret)
    seen: dict[str, Any] = {}
    if ctx.rank == 0:
        service.write(service.attach(service.create("w", 4)), torch.tensor([1.0, 2.0, 3.0, 4.0]))
        service.board.set_progress(7, 1)
    dist.barrier()
    if ctx.rank == 1:  # a board read before the attack (TERM reads it every iteration)
        seen["before"] = (service.board.progress(0), service.board.alive(0))
    dist.barrier()
    if ctx.rank == 2:
        host, _, port = payload["address"].rpartition(":")
        store = dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=10))
        nonce = store.get("smb/nonce").decode()
        fake = BufferKey("w", 1, 4, "float32", f"{payload['address']}/1").encode()
        store.set("smb/id/1", fake)  # create a buffer (the old protocol read ids from the store)
        store.set("smb/key/w", fake)  # re-point the name "w" at it (a lookup then read zeros)
        store.add("smb/claim/x", 1)
        store.set("smb/dead/1", "1")  # a plain liveness mark
        store.set("smb/dead/0", seal(b"guessed", nonce, "smb/dead/0", "1"))  # mark rank 0 dead, "sealed"
        store.set("smb/progress/0", seal(b"guessed", nonce, "smb/progress/0", "999,2"))  # rank 0 "done"
        for name, attempt in (("create", lambda: service.create("evil", 4)), ("lookup", lambda: service.lookup("w")),
                              ("write", lambda: service.write(service.attach(BufferKey.decode(fake)), torch.ones(4)))):
            try:
                attempt()
                seen[name] = "allowed"
            except PermissionError as exc:
                seen[name] = f"PermissionError: {exc}"
        deadline = time.monotonic() + 10  # the server puts back what the forged entries replaced
        while b"1" in store.get("smb/dead/0") or b"999" in store.get("smb/progress/0"):
            assert time.monotonic() < deadline, "the server did not put the board back"
            time.sleep(0.05)
    dist.barrier()
    if ctx.rank != 2:
        board = service.board
        key = service.lookup("w")
        seen.update(key=key.id, values=service.read(service.attach(key), torch.zeros(4)).tolist(),
                    alive=[board.alive(r) for r in range(2)], progress=board.progress(0), state=board.state(0))
    dist.barrier()
    service.close()
    return seen


def test_a_hostile_client_changes_nothing_through_the_store(tmp_path: Path) -> None:
    """Names, ids and liveness marks cannot be changed without the secret,
    and the server's log names each attempt (on the link: the client and the operation)."""
    secret_file = tmp_path / "secret"
    secret_file.write_text("right-secret\n")
    proc, address = start_server(3, "--secret-file", str(secret_file), "--snapshot-every", "30", "--out", str(tmp_path))
    try:
        results = launch("fabric.smb.test_remote:hostile_worker", 3, {"address": address}, timeout=90)
    finally:
        code, out, err = finish_server(proc)
    for legit in results[:2]:
        assert legit["key"] == 0 and legit["values"] == [1.0, 2.0, 3.0, 4.0], legit
        assert legit["alive"] == [True, True] and legit["progress"] == 7 and legit["state"] == 1, legit
    assert results[1]["before"] == (7, True)
    assert all(v.startswith("PermissionError") and "has not proven the shared secret" in v
               for v in results[2].values()), results[2]
    who = "client 2 (announced address 127.0.0.1) refused"
    for attempt in ("create of 'evil'", "lookup of 'w'", "write (buffer 1)"):
        assert f"{who} {attempt}: it has not proven the shared secret" in err, err
    for key in ("smb/id/1", "smb/key/w", "smb/claim/x", "smb/dead/0", "smb/dead/1", "smb/progress/0", "smb/progress/2"):
        assert f"refused store entry {key} = " in err, (key, err)
    assert "Exception raised from" not in err and "frame #" not in err, err  # no C++ stack traces
    snapshot = torch.load(tmp_path / "smb-snapshot.pt", weights_only=True)
    assert list(snapshot["buffers"]) == [0] and snapshot["buffers"][0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert code == 0 and "0 accumulations applied" in out, out + err


def test_the_board_refuses_entries_not_sealed_with_the_secret() -> None:
    """A reader ignores (and names) forged, unsealed and replayed board entries, keeps the
    last sealed value and puts it back; without a secret any well-formed entry counts."""
    import datetime

    from shmtrain.fabric.smb.board import StoreProgressBoard
    from shmtrain.fabric.smb.wire import seal

    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    lines: list[str] = []
    writer = StoreProgressBoard(store, 0, 2, secret=b"s", nonce="n", log=lines.append)
    reader = StoreProgressBoard(store, 1, 2, secret=b"s", nonce="n", log=lines.append)
    writer.set_progress(7, 1)
    old = store.get("smb/progress/0")
    writer.set_progress(8, 1)
    assert (reader.progress(0), reader.state(0), reader.alive(0)) == (8, 1, True)
    sealed = store.get("smb/progress/0")
    for forged in (seal(b"guess", "n", "smb/progress/0", "999,2"),  # the wrong secret
                   seal(b"s", "other-server", "smb/progress/0", "999,2"),  # another server's nonce
                   seal(b"s", "n", "smb/progress/1", "999,2"),  # another key's entry
                   "999,2"):
        store.set("smb/progress/0", forged)
        assert (reader.progress(0), reader.state(0)) == (8, 1), forged
        assert store.get("smb/progress/0") == sealed  # put back
    store.set("smb/progress/0", old)  # a replayed older entry, sealed: not newer than the one seen
    assert reader.progress(0) == 8
    store.set("smb/dead/0", seal(b"guess", "n", "smb/dead/0", "1"))
    assert reader.alive(0) and reader.forged == ["smb/progress/0"] * 4 + ["smb/dead/0"]
    assert "worker 1 ignored store entry smb/dead/0" in lines[-1] and "not sealed" in lines[-1]
    writer.mark_dead(0)
    assert not reader.alive(0)
    open_board = StoreProgressBoard(store, 1, 2, secret=None, nonce="n", log=lines.append)
    store.set("smb/progress/0", seal(None, "n", "smb/progress/0", "3,1"))
    assert open_board.progress(0) == 3


def malformed_worker(ctx, payload: dict[str, Any]) -> list[str]:
    service = RemoteBufferService(payload["address"], ctx.rank, ctx.world_size, timeout=30)
    seen = []
    if ctx.rank == 1:
        with service.lock:  # an unknown op, then an accumulate of buffers that do not exist
            for op, a in ((99, 0), (OP_ACCUMULATE, 12345)):
                seq, posted, _ = service.request(op, a, a + 1)
                try:
                    service.status(seq, posted, f"op {op}")
                except ValueError as exc:
                    seen.append(str(exc))
    dist.barrier()
    buffer = service.attach(service.create(f"after.{ctx.rank}", 8))  # and everyone is still served
    service.write(buffer, torch.full((8,), 2.0))
    seen.append(str(service.read(buffer, torch.zeros(8)).sum().item()))
    service.close()
    return seen


def test_malformed_requests_get_errors_and_serving_goes_on() -> None:
    proc, address = start_server(2)
    try:
        results = launch("fabric.smb.test_remote:malformed_worker", 2, {"address": address})
    finally:
        code, out, err = finish_server(proc)
    assert results[0] == ["16.0"]
    assert len(results[1]) == 3 and all("malformed request" in m for m in results[1][:2])
    assert results[1][2] == "16.0"
    assert "unknown op 99" in err and "accumulate 12345 into 12346: unknown buffers" in err
    assert code == 0, out + err


def silent_writer_worker(ctx, payload: dict[str, Any]) -> str:
    from shmtrain.fabric.smb.wire import OP_WRITE

    service = RemoteBufferService(payload["address"], ctx.rank, ctx.world_size, timeout=30)
    key = service.create(f"w{ctx.rank}", 64)
    buffer = service.attach(key)
    dist.barrier()
    if ctx.rank == 1:
        with service.lock:  # a malformed write (wrong size) whose payload never comes
            seq, posted, _ = service.request(OP_WRITE, key.id, 63)
            try:
                service.status(seq, posted, "the bad write")
            except ValueError:
                pass
    for _ in range(3):  # every client, this one too, is still served
        service.write(buffer, torch.full((64,), float(ctx.rank)))
    value = service.read(buffer, torch.zeros(64)).sum().item()
    service.close()
    return str(value)


def test_a_malformed_write_whose_payload_never_comes_stalls_no_one() -> None:
    proc, address = start_server(2)
    try:
        results = launch("fabric.smb.test_remote:silent_writer_worker", 2, {"address": address}, timeout=60)
    finally:
        code, out, err = finish_server(proc)
    assert results == ["0.0", "64.0"]
    assert "with 63 elements: no such buffer" in err


_TRUNCATING_CLIENT = """
import os, sys, torch
from shmtrain.fabric.smb.remote import RemoteBufferService
from shmtrain.fabric.smb.wire import OP_WRITE
service = RemoteBufferService(sys.argv[1], 1, 2, timeout=30)
target = service.lookup("target")
with service.lock:  # a write announced and accepted, then the client dies without its payload
    seq, posted, _ = service.request(OP_WRITE, target.id, target.numel)
    service.status(seq, posted, "the write")
os._exit(0)
"""


def test_a_client_lost_in_the_middle_of_a_write_changes_nothing_and_blocks_no_one() -> None:
    # (a header of the wrong size is not tested: gloo's receive of a mismatched message
    # breaks the server's any-source receive for everyone; docs/async.md says so)
    proc, address = start_server(2)
    client = subprocess.Popen([sys.executable, "-c", _TRUNCATING_CLIENT, address])
    try:
        service = RemoteBufferService(address, 0, 2, timeout=30)
        target = service.attach(service.create("target", 1000))
        service.write(target, torch.full((1000,), 7.0))
        client.wait(timeout=60)
        time.sleep(0.5)
        for _ in range(3):  # served while the lost client's write stays unapplied
            assert service.read(target, torch.zeros(1000)).sum().item() == 7000.0
        service.close()
    finally:
        if client.poll() is None:
            client.kill()
        code, out, err = finish_server(proc)
    assert "client 1 lost in the middle of a request" in err, err
    assert code == 0, out + err


@pytest.mark.parametrize("argv,message", [
    (["--clients", "0"], "--clients 0: at least one client"),
    (["--clients", "2", "--bind", "0.0.0.0"], "needs a shared secret"),
    (["--clients", "2", "--resume", "/nonexistent/snap.pt"], "no such snapshot file"),
    (["--clients", "2", "--snapshot-every", "-1"], "--snapshot-every -1"),
])
def test_bad_server_options_are_named(argv: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "shmtrain", "smb-server", "--port", "0", *argv],
                          capture_output=True, text=True, timeout=60,
                          env={**__import__("os").environ, "SHMTRAIN_SECRET": ""})
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_a_client_names_an_unreachable_server() -> None:
    with pytest.raises(Exception, match="cannot reach the memory server at 127.0.0.1"):
        RemoteBufferService(f"127.0.0.1:{free_port()}", 0, 1, timeout=2)


@pytest.mark.timeout(240)
# the server across hosts also carries runtime/hosts/test_lost_host_survivors.py's seasgd and hsgd runs
@pytest.mark.slow  # ~21 s per strategy
@pytest.mark.parametrize("strategy,standalone", [("seasgd", True), pytest.param("hsgd", False, marks=pytest.mark.slow)])
def test_asynchronous_strategies_span_two_hosts_through_the_server(tmp_path: Path, strategy: str,
                                                                   standalone: bool) -> None:
    """Two torchrun launches on this machine, each one host of 2 workers, share the global
    weights through one memory server: a stand-alone ``shmtrain smb-server`` (seasgd), or
    the one global rank 0 starts when the job spans hosts (hsgd, one group per host by
    default, its root the only client that accumulates). The started server ends with
    the job."""
    from support.torchrun import start_hosts

    before = set(running_servers())
    proc, address = start_server(4) if standalone else (None, "")
    nodes = []
    try:
        nodes = start_hosts(tmp_path, ["--strategy", strategy, "--iterations", "12", "--batch-size", "16",
                                       *(["--smb-server", address] if standalone else []), "--no-progress"])
        outputs = [p.communicate(timeout=200)[0].decode() for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
        if proc is not None:
            code, out, err = finish_server(proc)
    assert all(p.returncode == 0 for p in nodes), outputs
    summary = __import__("json").loads((tmp_path / "summary.json").read_text())
    # the average policy (TERM): the job's work is 4 x 12 iterations, however it is shared
    # out (a loaded host's rank 0, beside the memory server, may do fewer than the others)
    done = summary["iterations_per_rank"]
    assert summary["workers"] == 4 and len(done) == 4 and sum(done.values()) >= 4 * 12, done
    if standalone:
        applied = int(out.split("shmtrain smb-server: ")[-1].split(" accumulations")[0])
        assert code == 0 and applied >= 4 * 10, out + err  # every client's increments reached the server
    else:
        config = (tmp_path / "config.toml").read_text()
        assert 'smb-server = ""' in config  # no server was given: the job started its own
        deadline = time.monotonic() + 15
        while set(running_servers()) - before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not set(running_servers()) - before, "the memory server the job started outlived it"


def test_smb_server_option_is_checked_and_named(capsys) -> None:
    from shmtrain.cli import main

    assert main(["train", "--strategy", "seasgd", "--smb-server", "nowhere"]) == 2
    err = capsys.readouterr().err
    assert "--smb-server 'nowhere' must be HOST:PORT" in err, err


def test_losing_the_memory_server_ends_every_worker_with_its_name(tmp_path: Path) -> None:
    proc, address = start_server(2)
    train = subprocess.Popen([sys.executable, "-m", "shmtrain", "train", "--strategy", "seasgd", "--workers", "2",
                              "--iterations", "100000", "--smb-server", address, "--timeout", "20",
                              "--no-progress", "--out", str(tmp_path)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not list((tmp_path / "metrics").glob("rank-*.jsonl")) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # training, through the server
        proc.kill()
        killed = time.monotonic()
        _, err = train.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        if train.poll() is None:
            train.kill()
        finish_server(proc, wait=1)
    assert train.returncode == 1, err
    assert f"the memory server at {address} was lost" in err
    assert took < 20  # not the timeout: the closed connection is noticed at once


def test_bench_smb_remote_reports_the_service_beside_gloo(tmp_path: Path) -> None:
    from shmtrain.cli import main

    out = tmp_path / "rows.json"
    assert main(["bench", "smb", "--remote", "--procs", "2", "--size", "64KiB", "--reps", "2", "--samples", "1",
                 "--json", str(out)]) == 0
    rows = __import__("json").loads(out.read_text())
    ops = {r["op"] for r in rows}
    assert ops == {"gloo-read", "gloo-write", "read", "write", "readwrite", "accumulate"}
    assert all(r["aggregate_GBps"] > 0 for r in rows)
    assert all("vs_gloo" in r for r in rows if r["op"] in ("read", "write"))


@pytest.mark.parametrize("job_server", [False, True])
def test_a_lost_server_s_advice_fits_the_server(job_server: bool) -> None:
    """A stand-alone server is restarted from its snapshot; the job's own (started next to
    global rank 0) writes none, so its loss points to the job's checkpoint instead."""
    service = RemoteBufferService.__new__(RemoteBufferService)  # only the advice: no connection
    service.address, service.timeout, service.job_server = "10.0.0.1:29600", 30.0, job_server
    message = str(service._lost(RuntimeError("Connection closed by peer [10.0.0.1]:29600"), "reading W_g"))
    assert "was lost" in message and "reading W_g" in message and "shmtrain train --resume RUN_DIR" in message
    if job_server:
        assert "keeps no snapshot" in message and "--resume from its snapshot" not in message, message
    else:
        assert "--resume from its snapshot" in message and "on the same address" in message, message
