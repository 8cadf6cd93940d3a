"""The documented recovery of a stand-alone memory server: ``smb-server --snapshot-every``,
the server killed (SIGKILL) under a training job, started again with ``--resume`` from its
snapshot on the same address, and the job resumed from its checkpoint: it trains on to
the end (the buffers restored from the snapshot are taken over by the job's creates)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from conftest import run_main
from support.memory_server import finish_server, start_server
from support.runs import iterations_logged, start, wait_for
from support.torchrun import free_port

JOB = ["--strategy", "seasgd", "--workers", "2", "--model", "mlp", "--data", "synthetic", "--samples", "256",
       "--input-shape", "1x8x8", "--batch-size", "8", "--no-progress", "--checkpoint-every", "100",
       "--timeout", "30"]


def test_a_killed_memory_server_restarted_from_its_snapshot_serves_the_resumed_job(tmp_path: Path) -> None:
    port, out, snapshots = free_port(), tmp_path / "run", tmp_path / "smb"
    server, address = start_server(2, "--snapshot-every", "0.2", "--out", str(snapshots), port=port)
    try:
        launcher = start([*JOB, "--smb-server", address, "--iterations", "100000", "--out", str(out)])
        try:
            wait_for(lambda: (out / "checkpoints" / "step-200").exists() and (snapshots / "smb-snapshot.pt").exists(),
                     launcher, "a checkpoint and a snapshot")
            os.kill(server.pid, signal.SIGKILL)
            _, err = launcher.communicate(timeout=90)
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
    finally:
        finish_server(server, wait=5)
    assert launcher.returncode == 1 and f"the memory server at {address} was lost" in err, err
    assert "--resume from its snapshot" in err, err
    step = int((out / "checkpoints" / "latest").read_text().strip().removeprefix("step-"))
    server, _ = start_server(2, "--resume", str(snapshots / "smb-snapshot.pt"), "--out", str(snapshots), port=port)
    try:
        done = run_main("train", "--resume", str(out), "--iterations", str(step + 100))
    finally:
        code, served, served_err = finish_server(server)
    assert done.returncode == 0, done.stderr + served + served_err
    assert "already taken" not in done.stderr + served + served_err
    rows = iterations_logged(out, 0)
    assert rows[rows.index(step) + 1] == step + 1 and rows[-1] >= step + 100 - 5, rows[-3:]
    assert code == 0, served + served_err
