"""Tasks other than classification through the whole run: a regression and a dict-batch
task (a model of two inputs) trained by ``shmtrain train --task regression`` under ssgd
with 2 workers end with the weights of a plain single-process PyTorch loop over the union
of the workers' batches; the task options' and ``--task``'s errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.nn import functional
from torch.utils.data import default_collate

from shmtrain.cli import main
from shmtrain.runtime.config import resolve
from shmtrain.runtime.data.tensors import ShardSampler
from shmtrain.runtime.data.user_data import split_user_data
from shmtrain.runtime.tasks import build_task, registry
from shmtrain.runtime.tasks.base import split_batch
from support.paths import ROOT
from support.reference import relative_error
from support.task_data import Regressor, TwoInputs, dict_regression, regression

STEPS, BATCH, WORKERS, SEED, LR = 12, 8, 2, 0, 0.05


def plain_loop(dataset, model: torch.nn.Module, call) -> torch.Tensor:
    """SGD (lr, momentum 0.9, weight decay 1e-4: ``shmtrain train``'s defaults) on the
    union of the workers' batches of every step (the shard sampler's order), with
    ``call(model, batch) -> (output, target)``; the flat weights at the end."""
    train, _ = split_user_data("", dataset, None)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=1e-4)
    samplers = [ShardSampler(len(train), BATCH, WORKERS, rank, SEED) for rank in range(WORKERS)]
    for step in range(STEPS):
        order = torch.cat([s.indices(step) for s in samplers]).tolist()
        batch = default_collate([train[i] for i in order])
        opt.zero_grad()
        output, target = call(model, batch)
        functional.mse_loss(output, target.reshape(output.shape)).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def trained(out: Path, data: str, model: str) -> torch.Tensor:
    assert main(["train", "--task", "regression", "--data", data, "--model", model, "--workers", str(WORKERS),
                 "--iterations", str(STEPS), "--batch-size", str(BATCH), "--lr", str(LR), "--seed", str(SEED),
                 "--loader-workers", "0", "--out", str(out), "--no-progress"]) == 0
    state = torch.load(out / "model.pt")
    return torch.cat([v.reshape(-1) for v in state.values()])


@pytest.mark.timeout(150)
def test_regression_and_a_dict_batch_equal_a_plain_loop_under_ssgd(tmp_path: Path) -> None:
    # (x, y) items, the target a scalar against a (B, 1) output
    torch.manual_seed(SEED)
    reference = plain_loop(regression(), Regressor((6,), 1), lambda m, b: (m(b[0]), b[1]))
    got = trained(tmp_path / "pairs", "support.task_data:regression", "support.task_data:Regressor")
    assert relative_error(got, reference) < 1e-5
    torch.manual_seed(SEED)
    initial = torch.cat([p.detach().reshape(-1) for p in Regressor((6,), 1).parameters()])
    assert relative_error(reference, initial) > 1e-2
    summary = json.loads((tmp_path / "pairs" / "summary.json").read_text())
    assert summary["task"] == "regression" and summary["metric"] == "rmse" and summary["accuracy"] is None
    assert summary["rmse"] == pytest.approx(summary["metrics"]["loss"] ** 0.5)
    # shmtrain evaluate on the run gives the task's metric of its model.pt, as the run reported it
    assert main(["evaluate", str(tmp_path / "pairs"), "--out", str(tmp_path / "pairs-eval.json")]) == 0
    evaluated = json.loads((tmp_path / "pairs-eval.json").read_text())
    assert evaluated["task"] == "regression" and evaluated["rmse"] == pytest.approx(summary["rmse"], rel=1e-6)
    # dict items {"a", "b", "target"}: the model is called as model(a=..., b=...)
    torch.manual_seed(SEED)
    reference = plain_loop(dict_regression(), TwoInputs(1), lambda m, b: (m(a=b["a"], b=b["b"]), b["target"]))
    got = trained(tmp_path / "dicts", "support.task_data:dict_regression", "support.task_data:TwoInputs")
    assert relative_error(got, reference) < 1e-5
    evals = [json.loads(line)["eval"] for line in (tmp_path / "dicts" / "metrics" / "rank-0.jsonl").open()
             if '"eval"' in line]
    assert evals and set(evals[-1]) >= {"loss", "rmse"} and "accuracy" not in evals[-1]


def test_the_built_in_tasks_are_registered_with_their_metrics() -> None:
    tasks = registry()
    assert {"classification", "regression", "language-model"} <= set(tasks)
    assert (tasks["classification"].primary, tasks["regression"].primary,
            tasks["language-model"].primary) == ("accuracy", "rmse", "perplexity")
    assert resolve({}).task == "classification"


def test_the_language_model_task_scores_the_next_token() -> None:
    task = build_task("language-model")
    vocab = 5
    tokens = torch.tensor([[0, 1, 2, 3], [4, 3, 2, 1]])
    logits = torch.zeros(2, 3, vocab)

    def model(x: torch.Tensor) -> torch.Tensor:
        assert torch.equal(x, tokens[:, :-1])
        return logits
    metrics = task.metrics(task.sums(model, tokens))
    assert metrics["loss"] == pytest.approx(torch.log(torch.tensor(float(vocab))).item())
    assert metrics["perplexity"] == pytest.approx(vocab, rel=1e-6)


def test_a_batch_of_any_structure_is_split_for_accumulation() -> None:
    batch = {"a": torch.arange(5), "pair": (torch.arange(5) * 2, torch.ones(5, 2))}
    parts = split_batch(batch, 2)
    assert [len(p["a"]) for p in parts] == [3, 2]
    assert torch.equal(parts[1]["pair"][0], torch.tensor([6, 8]))


@pytest.mark.parametrize(("values", "message"), [
    ({"task": "translation"}, r"--task 'translation' is unknown; choose one of: classification, language-model, "
                              r"regression, or module:callable"),
    ({"task": "regression"}, r"--task regression with --data digits: .* give --data module:callable"),
    ({"task": "regression", "data": "support.task_data:regression", "task_args": "label_smoothing=0.1"},
     r"--task-args 'label_smoothing=0.1': label_smoothing does not apply to --task regression \(it takes target\)"),
    ({"task_args": "label_smoothing=2"}, r"--task-args label_smoothing=2: must be in \[0, 1\); use e.g."),
    ({"task": "support.task_data:nothing"}, r"--task 'support.task_data:nothing': support.task_data has no nothing"),
    ({"task": "support.task_data:regression"},
     r"--task 'support.task_data:regression' returned a TensorDataset, not a shmtrain Task"),
])
def test_task_errors_name_the_option_the_rule_and_the_fix(values: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve(values)


def test_a_dict_batch_without_the_target_names_the_keys_and_the_fix() -> None:
    task = build_task("regression")
    with pytest.raises(ValueError, match=r"without the target key 'target' \(its keys: a, y\); name the target's "
                                         r"key with --task-args 'target=\"KEY\"'"):
        task.loss(lambda **kw: kw["a"], {"a": torch.zeros(2, 1), "y": torch.zeros(2)})
    assert build_task("regression", 'target="y"').loss(lambda a: a, {"a": torch.zeros(2, 1), "y": torch.ones(2)}) == 1


def test_the_own_task_of_docs_tasks_md_runs() -> None:
    """The code block of docs/tasks.md "Your own task": a multi-label task's loss and metrics."""
    text = (ROOT / "docs" / "tasks.md").read_text()
    block = text.split("## Your own task")[1].split("```python")[1].split("```")[0]
    namespace: dict = {}
    exec(compile(block, "docs/tasks.md", "exec"), namespace)  # noqa: S102 - our own documentation
    task = namespace["MultiLabel"]()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    batch = (torch.randn(8, 4), torch.randint(0, 2, (8, 3)))
    loss = task.loss(model, batch)
    loss.backward()
    assert model.weight.grad is not None
    assert task.evaluate(model, [batch])["loss"] == pytest.approx(float(loss), rel=1e-6)
    assert task.output_size([(torch.zeros(4), torch.zeros(3))]) == 3


def test_the_worker_target_is_the_function() -> None:
    """run.py hands the launcher train_worker itself; a fresh worker process imports it by
    the name derived from the function."""
    import shmtrain.runtime.run.training as run
    from shmtrain.runtime.launch.launcher import target_name
    from shmtrain.runtime.launch.worker import resolve as resolve_target
    from shmtrain.runtime.run.loop import train_worker

    assert not hasattr(run, "TARGET") and run.train_worker is train_worker
    assert target_name(train_worker) == "shmtrain.runtime.run.loop:train_worker"
    assert resolve_target(target_name(train_worker)) is train_worker
    with pytest.raises(ValueError, match=r"must be a function defined at the top of an importable module"):
        target_name(lambda ctx, payload: None)
