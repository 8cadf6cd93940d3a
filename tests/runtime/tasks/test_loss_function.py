"""``--task module:callable`` naming a plain loss function ``loss(model, batch)``: it trains
under ssgd with 2 workers, a run stopped half way and resumed ends bit-identical to the
uninterrupted run, its held-out metrics are the loss and the metrics it returns (in the
run's summary and from ``shmtrain evaluate``), it trains on the built-in data too; a
callable that is neither a loss function nor a task is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shmtrain.cli import main
from shmtrain.runtime.config import resolve
from shmtrain.runtime.data.user_data import split_user_data
from shmtrain.runtime.tasks import build_task
from shmtrain.runtime.tasks.loss_function import LossFunction
from support.runs import iterations_logged, train, weights
from support.task_data import Regressor, mse_and_mae, regression

COMMON = ["--task", "support.task_data:mse_and_mae", "--data", "support.task_data:regression",
          "--model", "support.task_data:Regressor", "--workers", "2", "--batch-size", "8", "--lr", "0.05",
          "--seed", "0", "--loader-workers", "0", "--checkpoint-every", "6", "--no-progress"]


@pytest.mark.timeout(150)
def test_a_loss_function_trains_resumes_exactly_and_evaluates(tmp_path: Path) -> None:
    straight, run = tmp_path / "straight", tmp_path / "run"
    assert train(*COMMON, "--iterations", "12", "--out", str(straight)) == 0
    assert train(*COMMON, "--iterations", "6", "--out", str(run)) == 0
    assert train("--resume", str(run), "--iterations", "12") == 0
    a, b = weights(run / "model.pt"), weights(straight / "model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)  # bit-identical
    assert iterations_logged(run, 0) == list(range(1, 13))

    summary = json.loads((straight / "summary.json").read_text())
    assert summary["task"] == "support.task_data:mse_and_mae" and summary["metric"] == "loss"
    assert set(summary["metrics"]) == {"loss", "mae"}
    # it learned: the held-out loss is below that of the initial model (seed 0), computed here
    _, val = split_user_data("support.task_data:regression", regression(), None)
    torch.manual_seed(0)
    task = build_task("support.task_data:mse_and_mae", data="support.task_data:regression")
    batches = [tuple(torch.stack(column) for column in zip(*[val[i] for i in range(len(val))], strict=True))]
    initial = task.evaluate(Regressor((6,), 1), batches)
    assert summary["loss"] < 0.8 * initial["loss"] and summary["metrics"]["mae"] < initial["mae"]
    # shmtrain evaluate on the run gives the run's own final figures
    assert main(["evaluate", str(straight), "--out", str(tmp_path / "eval.json")]) == 0
    evaluated = json.loads((tmp_path / "eval.json").read_text())
    assert evaluated["metric"] == "loss" and evaluated["loss"] == pytest.approx(summary["loss"], rel=1e-6)
    assert evaluated["metrics"]["mae"] == pytest.approx(summary["metrics"]["mae"], rel=1e-6)


def test_a_loss_function_trains_on_the_built_in_data(tmp_path: Path) -> None:
    out = tmp_path / "digits"
    assert train("--task", "support.task_data:cross_entropy", "--data", "digits", "--model", "mlp", "--workers",
                 "2", "--iterations", "40", "--batch-size", "16", "--lr", "0.1", "--out", str(out),
                 "--no-progress") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metric"] == "loss" and summary["loss"] < 1.0  # ln(10) = 2.30 knows nothing
    assert json.loads((out / "classes.json").read_text())  # the built-in data's classes, as classification


def test_held_out_metrics_are_the_loss_and_what_it_returns_weighted_by_samples() -> None:
    task = build_task("support.task_data:mse_and_mae", data="support.task_data:regression")
    assert isinstance(task, LossFunction) and not task.takes_builtin_data and task.primary == "loss"
    model = torch.nn.Linear(2, 1)
    batches = [(torch.randn(5, 2), torch.randn(5)), (torch.randn(3, 2), torch.randn(3))]
    got = task.evaluate(model, batches)
    with torch.no_grad():
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        loss, metrics = mse_and_mae(model, (x, y))
    assert got["loss"] == pytest.approx(float(loss), rel=1e-5)
    assert got["mae"] == pytest.approx(float(metrics["mae"]), rel=1e-5)
    assert build_task("support.task_data:cross_entropy", data="digits").takes_builtin_data


@pytest.mark.parametrize(("values", "message"), [
    ({"task": "support.task_data:three_arguments", "data": "support.task_data:regression"},
     r"^--task 'support.task_data:three_arguments': it takes 3 required argument\(s\) \(model, batch, scale\); "
     r"name a loss function loss\(model, batch\) -> loss or \(loss, metrics\), a shmtrain Task subclass, or a "
     r"function of no required arguments returning a Task \(docs/tasks.md\)$"),
    ({"task": "support.task_data:Regressor", "data": "support.task_data:regression"},
     r"^--task 'support.task_data:Regressor': support.task_data.Regressor is a class but not a shmtrain Task; "
     r"name a loss function"),
    ({"task": "support.task_data:mse_and_mae", "data": "support.task_data:regression", "task_args": "scale=2"},
     r"^--task-args 'scale=2': --task support.task_data:mse_and_mae is a loss function \(model, batch\), which "
     r"takes no options; leave --task-args out$"),
])
def test_a_wrong_callable_is_refused_in_one_line(values: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        resolve(values)
    assert "\n" not in str(caught.value)


def test_a_wrong_loss_is_refused_naming_what_to_return() -> None:
    task = build_task("support.task_data:loss_of_shape", data="support.task_data:regression")
    with pytest.raises(ValueError, match=r"returned a loss of shape \(4,\); return the batch's mean, a 0-d tensor"):
        task.loss(torch.nn.Linear(2, 1), (torch.randn(4, 2), torch.randn(4)))


def test_a_wrong_callable_on_the_command_line_is_one_line(capsys) -> None:
    assert main(["train", "--task", "support.task_data:three_arguments", "--data", "support.task_data:regression",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "it takes 3 required argument(s)" in err[0], err
