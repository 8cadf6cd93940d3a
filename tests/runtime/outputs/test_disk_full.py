"""A full disk, on a small tmpfs each test mounts and unmounts (skipped
where mounting is not allowed): outputs are written atomically, the earlier file stays
intact, no temporary file is left, and the error names the path and the space needed;
the summary of a finished run is written before the optional plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shmtrain.runtime.files import OutputError, write_output
from shmtrain.runtime.outputs import report


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MB tmpfs at ``tmp_path/disk``, unmounted afterwards."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)
        if os.path.ismount(mount):
            subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path, leave: int) -> None:
    """Fill the disk but ``leave`` bytes."""
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    (disk / "filler").write_bytes(b"\0" * max(0, free - leave))


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.name.endswith((".tmp", ".part")) or ".tmp." in p.name)


def test_a_full_disk_keeps_the_earlier_file_and_names_path_and_space(disk: Path) -> None:
    target = disk / "model.pt"
    write_output(target, b"old" * 1000)
    fill(disk, 64 * 1024)
    with pytest.raises(OutputError) as info:
        write_output(target, b"x" * 300_000)
    message = str(info.value)
    assert str(target) in message and "No space left on device" in message, message
    assert "it needs 300.0 kB" in message and "free there" in message and "intact" in message, message
    assert target.read_bytes() == b"old" * 1000
    assert leftovers(disk) == []


def test_the_summary_is_written_before_the_plot(disk: Path) -> None:
    out = disk / "run"
    (out / "metrics").mkdir(parents=True)
    rows = [{"iteration": i, "loss": 1.0 / i, "lr": 0.1, "t0": float(i), "time": {"compute": 0.01, "comm": 0.002}}
            for i in range(1, 200)]
    (out / "metrics" / "rank-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fill(disk, 8 * 1024)  # room for summary.json, not for plot.png
    config = {"strategy": "ssgd", "model": "mlp", "data": "digits", "workers": 1}
    results = [{"rank": 0, "iterations": 199, "wall_s": 2.0, "final_loss": 0.005, "accuracy": 0.9}]
    with pytest.raises(OutputError, match="plot.png"):
        report.summarize(out, config, results, 2.5)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy"] == 0.9 and summary["iterations"] == 199
    assert not (out / "plot.png").exists() and leftovers(out) == []


def test_a_run_that_fills_the_disk_ends_with_one_line_naming_the_file(disk: Path) -> None:
    run = disk / "run"
    done = subprocess.run(
        [sys.executable, "-m", "shmtrain", "train", "--model", "wide_mlp", "--data", "synthetic",
         "--input-shape", "1x8x8", "--samples", "128", "--workers", "2", "--batch-size", "8",
         "--iterations", "3", "--no-progress", "--out", str(run)],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("shmtrain: error: worker rank"), last
    assert str(run / "checkpoints") in last and "No space left on device" in last and "it needs" in last, last
    assert (run / "config.toml").read_text().startswith("#") or "strategy" in (run / "config.toml").read_text()
    assert [p.name for p in run.rglob("*.part")] == []


def test_a_full_disk_mid_row_leaves_only_whole_rows(disk: Path) -> None:
    from shmtrain.runtime.files import LineLog

    path = disk / "rank-0.jsonl"
    log = LineLog(path, truncate=True)
    rows = [{"iteration": i, "loss": 0.5} for i in range(3)]
    log.write("".join(json.dumps(r) + "\n" for r in rows))
    fill(disk, 0)  # the file's last page still has room: the next row is written in part
    with pytest.raises(OutputError) as info:
        log.write(json.dumps({"iteration": 3, "pad": "x" * 20_000}) + "\n")
    log.close()
    assert str(path) in str(info.value) and "No space left on device" in str(info.value)
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows
    assert path.read_text().endswith("\n")


def test_more_free_than_needed_does_not_read_as_room(tmp_path: Path, monkeypatch) -> None:
    import shutil

    from shmtrain.runtime import files

    monkeypatch.setattr(shutil, "disk_usage", lambda _p: shutil._ntuple_diskusage(10**7, 8 * 10**6, 2 * 10**6))
    note = files.space_note(tmp_path / "rank-0.pt", 1_800_000)
    assert "it needs 1.8 MB" in note and "2.0 MB are free there now" in note and "other ranks" in note, note
    assert "it needs 1.8 MB; 2.0 MB are free there" not in note
    assert files.space_note(tmp_path / "x", 3_000_000) == "it needs 3.0 MB; 2.0 MB are free there"


def test_a_full_disk_behind_a_failed_worker_keeps_the_workers_report(tmp_path: Path, monkeypatch) -> None:
    """Recording the failed stretch (stretches.json) on the same full disk must not replace
    the worker's failure, which names the rank and its log."""
    from shmtrain.runtime.config import TrainConfig
    from shmtrain.runtime.launch.failures import WorkerFailed
    from shmtrain.runtime.outputs import stretches
    from shmtrain.runtime.run import end as run_end
    from shmtrain.runtime.run import training as run

    failure = WorkerFailed(f"worker rank 1 (pid 9) failed: cannot write metrics; its log: {tmp_path}/logs/rank-1.log",
                           1, 1)

    def launch(*_args, **_kwargs):
        raise failure

    def full(path: Path, _data: bytes) -> None:
        raise OutputError(f"cannot write {path}: No space left on device")

    monkeypatch.setattr(run, "launch", launch)
    monkeypatch.setattr(stretches, "write_output", full)
    warned: list[str] = []
    monkeypatch.setattr(run_end, "warn", warned.append)
    with pytest.raises(WorkerFailed) as info:
        run._run_local(TrainConfig(workers=2), tmp_path / "run", lambda *_: None, False)
    assert info.value is failure and "rank-1.log" in str(info.value)
    assert any("stretches.json" in w for w in warned), warned
