"""Evaluation and model selection: ``--keep-best`` keeps the best evaluation's model as
best.pt, ``--early-stop`` stops every worker once the metric stops improving (exit 0, a
finished run), and ``shmtrain evaluate`` gives the metrics of a run folder, a model file
and a checkpoint, equal to those the run reported; each option's errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shmtrain.cli import main
from shmtrain.runtime.config import resolve
from shmtrain.runtime.evaluate import evaluate


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-worker ssgd run at a learning rate high enough that the held-out loss stops
    improving long before its 200 iterations."""
    out = tmp_path_factory.mktemp("selection") / "run"
    assert main(["train", "--workers", "2", "--model", "mlp", "--iterations", "200", "--eval-every", "5",
                 "--lr", "0.5", "--keep-best", "loss", "--early-stop", "loss:2", "--out", str(out),
                 "--no-progress"]) == 0
    return out


@pytest.mark.timeout(150)
def test_keep_best_and_early_stop(run: Path) -> None:
    summary = json.loads((run / "summary.json").read_text())
    evals = [json.loads(line)["eval"] for line in (run / "metrics" / "rank-0.jsonl").open() if '"eval"' in line]
    losses = {e["iteration"]: e["loss"] for e in evals}
    best = json.loads((run / "best.json").read_text())
    assert best["metric"] == "loss" and best["value"] == min(losses.values())
    assert losses[best["iteration"]] == best["value"] and summary["best"] == best
    # stopped after 2 evaluations without improvement on the best, at one agreed iteration
    stop = summary["early_stopped"]
    assert stop is not None and stop < 200 and summary["iterations"] == stop
    after = sorted(i for i in losses if best["iteration"] < i < stop)
    assert len(after) >= 2 and all(losses[i] >= best["value"] for i in after)
    assert (run / "model.pt").is_file() and (run / "best.pt").is_file()


@pytest.mark.timeout(150)
def test_evaluate_a_run_a_model_file_and_a_checkpoint(run: Path, capsys: pytest.CaptureFixture) -> None:
    summary = json.loads((run / "summary.json").read_text())
    result = evaluate(str(run), {})
    assert result["metric"] == "accuracy" and result["task"] == "classification"
    assert result["accuracy"] == summary["accuracy"] and result["metrics"]["loss"] == pytest.approx(
        summary["held_out_loss"], rel=1e-6)
    best = json.loads((run / "best.json").read_text())
    assert evaluate(str(run / "best.pt"), {})["metrics"]["loss"] == pytest.approx(best["value"], rel=1e-6)
    latest = evaluate(str(run / "checkpoints" / "latest"), {})  # the final checkpoint: model.pt's weights
    assert latest["metrics"] == result["metrics"] and latest["model"].endswith(f"step-{summary['iterations']}")
    assert main(["evaluate", str(run), "--out", str(run / "e.json")]) == 0
    assert "accuracy" in capsys.readouterr().out
    assert json.loads((run / "e.json").read_text())["metrics"] == result["metrics"]


@pytest.mark.parametrize(("values", "message"), [
    ({"keep_best": "rmse"}, r"--keep-best 'rmse': --task classification reports loss, accuracy; name one of them, "
                            r"e.g. --keep-best accuracy"),
    ({"early_stop": "loss"}, r"--early-stop 'loss': write METRIC:PATIENCE, .* e.g. --early-stop loss:3"),
    ({"early_stop": "loss:0"}, r"--early-stop 'loss:0': write METRIC:PATIENCE"),
    ({"early_stop": "loss:3", "eval_every": 0}, r"--early-stop 'loss:3': it compares held-out evaluations, and "
                                                r"--eval-every 0 makes none during the run; drop --eval-every 0"),
])
def test_selection_errors_name_the_option_the_rule_and_the_fix(values: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve(values)


def test_evaluate_refuses_what_is_not_a_run(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"not a run folder of shmtrain train \(no model.pt and config.toml\)"):
        evaluate(str(tmp_path), {})
    (tmp_path / "config.toml").write_text('data = "digits"\n')
    with pytest.raises(ValueError, match=r"the run folder has no model.pt \(the run did not finish\); evaluate "
                                         r"one of its checkpoints instead"):
        evaluate(str(tmp_path), {})
