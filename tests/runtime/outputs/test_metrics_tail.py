"""A metrics file's end, read from the end (``runtime/outputs/metrics_tail.py``): the last
iteration logged and the file cut back to a step, equal to parsing every row, with lines
a kill cut short and blocks that split lines anywhere."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from shmtrain.runtime.outputs import metrics_tail

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("block", [1, 7, 64 << 10])
def test_the_tail_reads_what_a_whole_parse_reads(tmp_path: Path, monkeypatch, block: int) -> None:
    monkeypatch.setattr(metrics_tail, "BLOCK", block)
    path = tmp_path / "rank-0.jsonl"
    for trial in range(200):
        rnd = random.Random(trial)
        rows = []
        for i in range(1, rnd.randint(1, 40)):
            rows.append({"iteration": i, "loss": rnd.random()})
            if rnd.random() < 0.2:
                rows.append({"eval": {"iteration": i, "loss": 1.0}})
        text = "".join(json.dumps(r) + "\n" for r in rows)
        if rnd.random() < 0.5:
            text += '{"iteration": 99, "lo'  # the line a kill cut short
        path.write_text(text)
        train = [r["iteration"] for r in rows if "eval" not in r]
        assert metrics_tail.last_iteration(path) == (train[-1] if train else 0), trial
        upto = rnd.randint(0, 42)
        metrics_tail.cut_after(path, upto)
        at = [r["eval"]["iteration"] if "eval" in r else r["iteration"] for r in rows]
        assert path.read_text() == "".join(json.dumps(r) + "\n" for r, i in zip(rows, at, strict=True) if i <= upto)


def test_no_file_and_an_empty_file_have_logged_nothing(tmp_path: Path) -> None:
    assert metrics_tail.last_iteration(tmp_path / "none.jsonl") == 0
    (tmp_path / "empty.jsonl").write_text("")
    assert metrics_tail.last_iteration(tmp_path / "empty.jsonl") == 0
    metrics_tail.cut_after(tmp_path / "none.jsonl", 3)  # nothing to cut
    assert not (tmp_path / "none.jsonl").exists()
