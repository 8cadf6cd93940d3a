"""``shmtrain bench hosts`` (issue 12): time to accuracy across two namespaced hosts.

The quick variant runs every method (ssgd, hsgd, seasgd, DDP) on two network
namespaces joined by a veth pair shaped to 1 Gbit; it needs root and ``ip netns`` and
skips with the reason elsewhere (like ``tests/test_netns.py``). No namespace may be
left behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shmtrain.bench import hosts

pytestmark = pytest.mark.timeout(240)


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


@pytest.mark.parametrize("methods", [
    ["ssgd"],  # the memory server across namespaced hosts: tests/test_netns.py
    pytest.param(None, marks=pytest.mark.slow),  # every default method, ddp included (~50 s)
])
def test_quick_bench_gives_every_method_a_time_to_accuracy(tmp_path: Path, methods: list[str] | None) -> None:
    reason = hosts.why_not("1gbit")
    if reason:
        pytest.skip(reason)
    out, doc_file, png = tmp_path / "runs", tmp_path / "hosts.json", tmp_path / "hosts.png"
    chosen = ["--methods", *methods] if methods else []
    proc = subprocess.run([sys.executable, "-m", "shmtrain", "bench", "hosts", "--quick", "--out", str(out),
                           "--json", str(doc_file), "--plot", str(png), *chosen],
                          capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(doc_file.read_text())
    assert [row["method"] for row in doc["rows"]] == (methods or hosts.DEFAULT_METHODS)
    for row in doc["rows"]:
        for key in ("time_to_target_s", "train_time_to_target_s", "final_accuracy", "comm_ms", "startup_s"):
            assert isinstance(row[key], int | float) and row[key] >= 0, (row["method"], key, row[key])
        assert row["final_accuracy"] >= doc["settings"]["target"], row
        assert row["iterations"] >= 1 and row["comm_ms"] > 0 and row["runs"][0]["curve"], row
    assert "s to target" in proc.stdout and all(m in proc.stdout for m in methods or hosts.DEFAULT_METHODS)
    assert png.stat().st_size > 0
    assert len(doc["namespaces"]) == 2 and not set(doc["namespaces"]) & _namespaces(), "a namespace was left behind"


def test_without_root_it_says_why_instead_of_a_traceback(monkeypatch, capsys) -> None:
    from shmtrain.cli import main

    monkeypatch.setattr(hosts.os, "geteuid", lambda: 1000)
    assert main(["bench", "hosts", "--quick", "--methods", "ssgd"]) == 2
    err = capsys.readouterr().err
    assert "shmtrain: error: bench hosts cannot make two hosts here: network namespaces need root" in err
    assert "Traceback" not in err


def test_an_unknown_method_or_rate_is_refused(capsys) -> None:
    from shmtrain.cli import main

    assert main(["bench", "hosts", "--methods", "ssgd", "nccl"]) == 2
    assert "--methods ['nccl']: unknown; choose from ssgd, hsgd, seasgd, ddp" in capsys.readouterr().err
    assert main(["bench", "hosts", "--rate", "fast"]) == 2
    assert "--rate 'fast'" in capsys.readouterr().err
