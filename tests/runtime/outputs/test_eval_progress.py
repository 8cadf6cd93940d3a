"""A long held-out evaluation says how far it is (``runtime/outputs/progress.py``): the
batches pass through unchanged, and a line gives the items done of the total."""

from __future__ import annotations

import io

import pytest
import torch

from shmtrain.runtime.outputs.progress import evaluation_progress

pytestmark = pytest.mark.timeout(30)


def test_an_evaluation_reports_the_items_done_and_passes_every_batch_on() -> None:
    batches = [(torch.zeros(4, 2), torch.zeros(4)) for _ in range(3)] + [(torch.zeros(2, 2), torch.zeros(2))]
    out = io.StringIO()
    seen = list(evaluation_progress(batches, 14, 700, stream=out, every=0.0))
    assert all(a is b for a, b in zip(seen, batches, strict=True))
    lines = out.getvalue().splitlines()
    assert [line.split(": ")[1].split(" ")[0] for line in lines] == ["4/14", "8/14", "12/14", "14/14"]
    assert lines[0].startswith("evaluating the model of iteration 700")


def test_a_short_evaluation_says_nothing() -> None:
    out = io.StringIO()
    assert len(list(evaluation_progress([{"x": torch.zeros(3)}] * 5, 15, 1, stream=out))) == 5
    assert out.getvalue() == ""
