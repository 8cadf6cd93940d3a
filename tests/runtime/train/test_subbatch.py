"""SUB-BATCH (swCaffe Algorithm 1): ``--sub-batch K`` splits each worker's mini-batch
over K threads and averages their gradients before the workers communicate; the weights
equal one thread's (relative error < 1e-5) with every synchronous strategy, and the
asynchronous ones train. The models here have no batch norm (``tiny_model``, ``mlp``):
with it, each part normalizes by its own statistics, which is checked apart."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

from shmtrain.cli import main
from shmtrain.models import build_model
from shmtrain.runtime.launch.launcher import launch
from shmtrain.runtime.train.subbatch import SubBatch
from shmtrain.runtime.train.trainer import Trainer
from shmtrain.timing import PhaseTimer
from support.reference import (
    batches,
    flat_params,
    relative_error,
    single_process_sgd,
    tiny_model,
    worker_batch,
)

#: (name, strategy, options); synchronous: the same weights as single-process SGD
SYNCHRONOUS = [
    ("ssgd", "ssgd", {}),
    ("ssgd_overlap", "ssgd", {"overlap": True, "bucket_mb": 0.001}),
    ("gpi", "gpi", {}),
    ("cpu_acc", "cpu_acc", {}),
    ("ps_grad", "ps_grad", {}),
    ("ps_weight", "ps_weight", {}),
    # one group of 2: the group's allreduce; SEASGD with the global weights never due
    ("hsgd", "hsgd", {"update_interval": 1000}),
]
ASYNCHRONOUS = [("seasgd", "seasgd", {}), ("easgd", "easgd", {}), ("downpour", "downpour", {})]
STEPS, BATCH, PARTS = 3, 5, 2  # 5 = 3 + 2: an uneven split


class Engine:
    """``DataParallel``'s calls around a plain optimizer (one process, no strategy)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = model, optimizer
        self.forwards = 0

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def before_forward(self) -> None:
        self.forwards += 1

    def step(self) -> None:
        self.optimizer.step()


def train_alone(model: nn.Module, sub_batch: int, steps: int = 4, batch: int = 12) -> tuple[torch.Tensor, Trainer]:
    """Weights after ``steps`` iterations of one process with ``sub_batch`` threads."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    timer = PhaseTimer()
    trainer = Trainer(Engine(model, optimizer), nn.CrossEntropyLoss(), timer, sub_batch=sub_batch)
    gen = torch.Generator().manual_seed(3)
    try:
        for _ in range(steps):
            x = torch.randn((batch, *model.input_shape), generator=gen)  # type: ignore[arg-type]
            trainer.step(x, torch.randint(0, 10, (batch,), generator=gen))
            trainer.phases = timer.finish_iteration()  # type: ignore[attr-defined]
    finally:
        trainer.close()
    return flat_params(model), trainer


def mlp() -> nn.Module:
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    model.input_shape = (1, 8, 8)  # type: ignore[assignment]
    return model


@pytest.mark.parametrize("parts", [2, 3, 5, 12])
def test_threads_give_the_weights_of_one_thread(parts: int) -> None:
    reference, _ = train_alone(mlp(), 1)
    weights, trainer = train_alone(mlp(), parts)  # 12 samples: 3 and 5 split unevenly
    assert relative_error(weights, reference) < 1e-5
    assert trainer.engine.forwards == 4  # the strategy's before_forward: once per iteration
    assert trainer.phases["forward"] > 0 and trainer.phases["backward"] > 0
    assert trainer.phases["compute"] >= trainer.phases["forward"] + trainer.phases["backward"]
    assert not [t for t in threading.enumerate() if t.name.startswith("shmtrain-subbatch")]


def test_each_part_normalizes_by_its_own_statistics() -> None:
    """Batch norm: the weights differ from one thread's (each part has its own batch
    statistics), while the running mean after one iteration is one thread's exactly (the
    size-weighted mean of the parts' means is the batch mean)."""
    def model() -> nn.Module:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 10))
        net.input_shape = (1, 8, 8)  # type: ignore[assignment]
        return net

    one, two = model(), model()
    train_alone(one, 1, steps=1, batch=7)
    train_alone(two, 2, steps=1, batch=7)
    assert relative_error(two[1].running_mean, one[1].running_mean) < 1e-6
    assert int(two[1].num_batches_tracked) == 1
    assert relative_error(two[1].running_var, one[1].running_var) > 1e-6  # the parts' spread is left out
    assert relative_error(flat_params(two), flat_params(one)) > 1e-6


class SlowInput(torch.autograd.Function):
    """Identity whose backward sleeps: the input end of backward takes 0.3 s."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ARG004 - autograd's signature
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        time.sleep(0.3)
        return grad


class SlowStart(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(4, 8), nn.Linear(8, 3)
        self.unused = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(SlowInput.apply(self.first(x))))


def test_gradients_reach_the_hooks_while_the_threads_still_compute() -> None:
    """The last layer's averaged gradient fires the model's hooks before the parts'
    backward has reached the (slow) input end: what keeps ssgd --overlap, gpi and cpu_acc
    overlapped; a parameter no part reached gets no gradient, as in a plain backward."""
    model = SlowStart()
    fired: dict[str, float] = {}
    def record(name: str):
        def hook(_: torch.Tensor) -> None:
            fired[name] = time.perf_counter()
        return hook

    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(record(name))
    sub = SubBatch(model, 2, nn.CrossEntropyLoss())
    try:
        sub.step(torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2]))
        done = time.perf_counter()
    finally:
        sub.close()
    assert set(fired) == {"first.weight", "first.bias", "last.weight", "last.bias"}
    assert done - fired["last.weight"] > 0.2  # delivered during the parts' 0.3 s sleep
    assert model.unused.weight.grad is None


def test_a_failing_part_raises_and_leaves_no_thread() -> None:
    model = mlp()
    sub = SubBatch(model, 2, nn.CrossEntropyLoss())
    with pytest.raises(IndexError):
        sub.step(torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 99]))  # class 99 of 10: in part 2
    assert all(p.grad is None for p in model.parameters())  # nothing half-delivered
    sub.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("shmtrain-subbatch")]


def test_bad_sub_batch_is_named() -> None:
    with pytest.raises(ValueError, match=r"--sub-batch 0: .* at least 1"):
        SubBatch(mlp(), 0, nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match=r"--sub-batch 2: the loss has reduction='none'"):
        SubBatch(mlp(), 2, nn.CrossEntropyLoss(reduction="none"))


def strategies_worker(ctx, payload: dict[str, Any]) -> dict[str, Any]:
    """Run every configuration of ``payload`` in turn (each strategy's fabric is its own,
    so one launch serves them all); weights per step, and the losses."""
    from shmtrain.parallel.data_parallel import DataParallel

    world = ctx.world_size
    out: dict[str, Any] = {}
    for name, strategy, options in payload["runs"]:
        steps = payload["steps"]
        model = tiny_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
        dp = DataParallel(model, optimizer, strategy, ctx=ctx, **options)
        trainer = Trainer(dp, nn.CrossEntropyLoss(), dp.timer, sub_batch=PARTS)
        x, y = batches(steps, BATCH * world)
        history, losses = [], []
        for step in range(steps):
            # memorize: the same batch every step, so the loss must fall
            xs, ys = worker_batch(x, y, 0 if payload["memorize"] else step, ctx.rank, BATCH, world)
            losses.append(float(trainer.step(xs, ys)))
            dp.timer.finish_iteration()
            history.append(flat_params(model))
        trainer.close()
        dp.close()
        out[name] = {"history": history, "losses": losses}
    return out


def test_every_synchronous_strategy_gives_the_weights_of_one_thread() -> None:
    """Two workers, two threads each, batch 5 split 3 + 2: after every step the weights are
    single-process SGD's on the union batch, i.e. ``--sub-batch 1``'s (ssgd --overlap, gpi
    and cpu_acc get the averaged gradient through their gradient hooks)."""
    results = launch("runtime.train.test_subbatch:strategies_worker", 2,
                     {"runs": SYNCHRONOUS, "steps": STEPS, "memorize": False}, timeout=120)
    reference = single_process_sgd(STEPS, BATCH, 2)
    for name, _, _ in SYNCHRONOUS:
        for rank, result in enumerate(results):
            for step, (weights, expected) in enumerate(zip(result[name]["history"], reference, strict=True), 1):
                error = relative_error(weights, expected)
                assert error < 1e-5, f"{name}, rank {rank}, step {step}: relative error {error:.2e}"


@pytest.mark.parametrize("run", ASYNCHRONOUS, ids=[name for name, _, _ in ASYNCHRONOUS])
def test_asynchronous_strategies_train(run: tuple[str, str, dict[str, Any]]) -> None:
    """Not deterministic from run to run (the exchanges race the steps): the loss reaches a
    tenth of its start. Not "the last steps' mean halves": with momentum 0.9 in each worker's
    optimizer, a worker that runs several steps while the other waits for a core drives W_g
    with its velocity alone, and the other's next loss can spike (up to 8.1 in 36 loaded launches
    of downpour here, 0.00 the step before and after). The order alone does it:
    :func:`test_the_order_of_the_steps_alone_spikes_downpour`. One launch each: a job's
    buffer service holds the global weights' name once."""
    results = launch("runtime.train.test_subbatch:strategies_worker", 2,
                     {"runs": [run], "steps": 30, "memorize": True}, timeout=120)
    for rank, result in enumerate(results):
        losses = result[run[0]]["losses"]
        first, best = sum(losses[:5]) / 5, min(losses[5:])
        assert best < 0.1 * first, f"{run[0]}, rank {rank}: loss {first:.3f} -> best {best:.3f}: {losses}"


def _downpour_in_order(seed: int, steps: int = 30) -> list[list[float]]:
    """ShmCaffe eq. (1) with the two workers of the test above, one process, no concurrency:
    at each turn a worker drawn at random (``seed``) steps its optimizer on its own batch,
    adds its increment into W_g and fetches W_g. Each worker's losses."""
    import random

    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    draw = random.Random(seed)
    x, y = batches(steps, BATCH * 2)
    models = [tiny_model() for _ in range(2)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3) for m in models]
    global_weights = parameters_to_vector(models[0].parameters()).detach().clone()
    fetched = [global_weights.clone(), global_weights.clone()]
    losses: list[list[float]] = [[], []]
    while min(map(len, losses)) < steps:
        rank = draw.randrange(2) if max(map(len, losses)) < steps else min((0, 1), key=lambda r: len(losses[r]))
        xs, ys = worker_batch(x, y, 0, rank, BATCH, 2)
        optimizers[rank].zero_grad()
        loss = nn.functional.cross_entropy(models[rank](xs), ys)
        loss.backward()
        optimizers[rank].step()
        losses[rank].append(loss.item())
        global_weights += parameters_to_vector(models[rank].parameters()).detach() - fetched[rank]
        vector_to_parameters(global_weights.clone(), models[rank].parameters())
        fetched[rank] = global_weights.clone()
    return losses


@pytest.mark.slow  # ~27 s loaded: why the check above asks for the best loss, not the last steps' mean
def test_the_order_of_the_steps_alone_spikes_downpour() -> None:
    """Without any concurrency, only the order of the workers' steps drawn at random, the
    last 5 steps' mean misses half the first 5's in some runs (a spike in the last steps: 3
    of these 60 here, seeds 41, 45 and 66, by 1.0-1.6 against 0.87-0.95); the best loss of
    steps 6-30 reaches a tenth of the start in every run (7 of 160 missed and none failed
    over seeds 40-119)."""
    runs = [losses for seed in range(40, 70) for losses in _downpour_in_order(seed)]
    starts = [sum(losses[:5]) / 5 for losses in runs]
    missed = [i for i, (losses, first) in enumerate(zip(runs, starts, strict=True))
              if not sum(losses[-5:]) / 5 < 0.5 * first]
    assert missed, "no run spiked in its last steps: the old check would have held"
    assert all(min(losses[5:]) < 0.1 * first for losses, first in zip(runs, starts, strict=True))


@pytest.mark.parametrize("value,words", [("0", ["--sub-batch 0", "at least 1"]),
                                         ("9", ["--sub-batch 9", "--batch-size 8"])])
def test_cli_refuses_a_bad_sub_batch(value: str, words: list[str], tmp_path, capsys) -> None:
    code = main(["train", "--sub-batch", value, "--batch-size", "8", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and all(w in err for w in words), err
    assert not (tmp_path / "run").exists()


def test_shmtrain_train_sub_batch_gives_the_weights_of_one_thread(tmp_path) -> None:
    """``shmtrain train --sub-batch 3`` (batch 8: 3 + 3 + 2) through the worker loop: the
    weights of ``--sub-batch 1``, the phases in the metrics, the key in config.toml."""
    import json

    common = ["--workers", "2", "--model", "smallcnn", "--data", "synthetic", "--samples", "64",
              "--input-shape", "1x8x8", "--batch-size", "8", "--iterations", "4", "--no-progress"]
    assert main(["train", *common, "--out", str(tmp_path / "one")]) == 0
    assert main(["train", *common, "--sub-batch", "3", "--out", str(tmp_path / "three")]) == 0
    one, three = torch.load(tmp_path / "one" / "model.pt"), torch.load(tmp_path / "three" / "model.pt")
    for name in one:
        assert relative_error(three[name], one[name]) < 1e-5, name
    assert "sub-batch = 3" in (tmp_path / "three" / "config.toml").read_text()
    row = json.loads((tmp_path / "three" / "metrics" / "rank-1.jsonl").read_text().splitlines()[-1])
    assert row["time"]["forward"] > 0 and row["time"]["backward"] > 0


def test_bench_subbatch_quick(tmp_path, capsys) -> None:
    import json

    out = tmp_path / "subbatch.json"
    assert main(["bench", "subbatch", "--quick", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["mode"], r["processes"], r["threads_per_process"]) for r in rows] == [
        ("1 thread", 1, 1), ("2 threads", 1, 2), ("2 processes", 2, 1)]
    assert all(r["median_ms"] > 0 and r["samples_per_s"] > 0 for r in rows)
    assert rows[1]["threads_vs_processes"] == pytest.approx(rows[1]["median_ms"] / rows[2]["median_ms"])
    assert "thr/proc" in capsys.readouterr().out
    assert main(["bench", "subbatch", "--parts", "1"]) == 2
