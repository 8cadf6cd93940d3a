"""ShmtrainStrategy: a Lightning run of each shmtrain method equals the same method through
``shmtrain.DataParallel`` in a plain loop (the synchronous ones to rel < 1e-6, under
Lightning's own launcher and under torchrun; the asynchronous ones to the same accuracy
within noise), and its loggers see the phase times."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning", reason="Lightning is not installed (pip install -e '.[test]')")

from support.lightning_runs import (  # noqa: E402
    lightning_command,
    lightning_torchrun_command,
    plain_command,
    rel,
    run,
    seen,
    weights,
)

SYNC = {
    "ssgd": ("ssgd", {}),
    "ssgd-overlap": ("ssgd", {"overlap": True, "bucket_mb": 0.0005}),
    "ssgd-sharded-update": ("ssgd", {"sharded_update": True}),
    "ssgd-bf16": ("ssgd", {"comm_dtype": "bf16"}),
    "cpu_acc": ("cpu_acc", {}),
    "ps_grad": ("ps_grad", {}),
    "gpi": ("gpi", {}),
}


@pytest.mark.parametrize("case", [c if c == "ssgd" else pytest.param(c, marks=pytest.mark.slow) for c in SYNC])
def test_a_lightning_run_equals_dataparallel_in_a_plain_loop(tmp_path: Path, case: str) -> None:
    method, options = SYNC[case]
    ours, torchrun, plain = tmp_path / "lightning.pt", tmp_path / "torchrun.pt", tmp_path / "plain.pt"
    logs = tmp_path / "logs"
    run({"lightning": lightning_command(ours, method=method, options=options, log_dir=str(logs)),
         "torchrun": lightning_torchrun_command(torchrun, method=method, options=options),
         "plain": plain_command(plain, method=method, options=options)})
    assert rel(weights(plain), weights(ours)) < 1e-6, case  # Lightning's own launcher
    assert rel(weights(plain), weights(torchrun)) < 1e-6, case  # Lightning under torchrun
    assert seen(ours)["iteration"] == seen(plain)["iteration"] == 16  # 2 epochs of 8 steps
    assert seen(ours)["accuracy"] > seen(plain)["initial_accuracy"]  # it trained
    # the loggers saw shmtrain's phases: the CSV logger's columns, a row every 2 steps
    metrics = (logs / "run" / "version_0" / "metrics.csv").read_text().splitlines()
    header = metrics[0].split(",")
    for phase in ("shmtrain/forward", "shmtrain/backward", "shmtrain/comm", "shmtrain/update"):
        assert phase in header, header
    assert len(metrics) - 1 == 8  # 16 steps, log_every_n_steps=2
    assert seen(ours)["phases"]["shmtrain/comm"] > 0


ASYNC: dict[str, tuple[str, dict[str, Any]]] = {
    "seasgd": ("seasgd", {"update_interval": 2}),
    "easgd": ("easgd", {"update_interval": 2}),
    "downpour": ("downpour", {}),
    "hsgd": ("hsgd", {"groups": 2, "group_size": 1}),
    "diloco-compress": ("diloco", {"sync_every": 4, "compress": "topk:0.25"}),
    "ps_weight": ("ps_weight", {}),
}


@pytest.mark.slow  # ~40 s each on 2 cores; the default suite resumes seasgd (test_checkpoint.py)
@pytest.mark.parametrize("case", list(ASYNC))
def test_an_asynchronous_method_reaches_the_accuracy_of_its_plain_loop(tmp_path: Path, case: str) -> None:
    method, options = ASYNC[case]
    ours, plain = tmp_path / "lightning.pt", tmp_path / "plain.pt"
    settings = {"method": method, "options": options, "epochs": 4, "samples": 256}
    run({"lightning": lightning_command(ours, **settings), "plain": plain_command(plain, **settings)})
    a, b = seen(ours), seen(plain)
    assert a["iteration"] == b["iteration"] == 64, (a, b)  # 4 epochs of 16 steps, every step the method's
    start = b["initial_accuracy"]
    assert a["accuracy"] > start + 0.1 and b["accuracy"] > start + 0.1, (start, a, b)  # both learned
    assert abs(a["accuracy"] - b["accuracy"]) <= 0.1, (a, b)  # the same, within the asynchrony's noise
    if "centre_accuracy" in b:  # W_g, the centre variable, where the method has one
        assert abs(a["centre_accuracy"] - b["centre_accuracy"]) <= 0.1, (a, b)
