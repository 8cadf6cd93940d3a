"""``shmtrain bench overlap``'s peer and copy columns on the CPU: ``ddp_gloo`` (DDP over
gloo, the model on the benchmark's device), the pinned baseline and the registration of
the shared buffers (``n/a`` off a GPU), in the rows, the JSON and the tables."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from shmtrain.bench import overlap


def test_ddp_gloo_and_the_copy_columns_on_the_cpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    modes = ["nocomm", "ddp_gloo", "ssgd@copy", "ps_grad"]
    parser = argparse.ArgumentParser()
    overlap._arguments(parser)
    args = parser.parse_args(["--model", "smallcnn", "--input-shape", "1x8x8", "--batch-size", "4",
                              "--workers", "2", "--rounds", "2", "--warmup", "1", "--modes", *modes,
                              "--json", str(tmp_path / "rows.json")])
    assert overlap._handler(args) == 0
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["mode"] for r in rows] == modes
    assert all(r["median_s"] > 0 and r["vs_nocomm"] > 0 for r in rows)
    for row in rows:  # nothing to page-lock or to compare with pinned memory on the CPU
        assert row["registered"] == "n/a" and row["pinned_d2h_ms"] == "n/a" and row["pinned_h2d_ms"] == "n/a"
        assert row["copy_vs_pinned"] == "n/a"
    staged = rows[modes.index("ssgd@copy")]
    assert staged["hidden"] is not None and staged["phases_s"]["copy_to_host"] > 0
    text = capsys.readouterr().out
    assert "registered" in text.splitlines()[0] and "ddp_gloo" in text
    copies = text.split("staged copies per iteration")[1]
    assert "pinned D2H ms" in copies and "copy vs pinned" in copies and "n/a" in copies


def test_unknown_modes_are_refused() -> None:
    overlap.check_modes(["nocomm", "ddp_gloo", "ddp", "ps_grad", "gpi@copy"])
    with pytest.raises(ValueError, match=r"--modes ddp@copy ddp-glo: unknown; choose from ddp, "):
        overlap.check_modes(["ddp@copy", "ddp-glo"])
