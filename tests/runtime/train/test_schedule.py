"""Learning-rate schedules (``runtime/train/schedule.py``): the values are torch.optim.lr_scheduler's
own, the Trainer steps the scheduler once per iteration, and its state continues exactly."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import (
    ConstantLR,
    CosineAnnealingLR,
    LinearLR,
    LRScheduler,
    SequentialLR,
    StepLR,
)

from shmtrain.cli import main
from shmtrain.runtime.train.schedule import build_scheduler
from shmtrain.runtime.train.trainer import Trainer
from shmtrain.timing import PhaseTimer

BASE, TOTAL = 0.2, 30


def optimizer(lr: float = BASE) -> torch.optim.SGD:
    return torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=lr, momentum=0.9)


def lrs(scheduler: LRScheduler | None, opt: torch.optim.Optimizer, n: int) -> list[float]:
    """The learning rate each of ``n`` iterations uses (read before the step, as the loop)."""
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return out


def test_constant_is_the_base_rate_and_with_warmup_equals_linear_lr() -> None:
    opt = optimizer()
    assert lrs(build_scheduler(opt, "constant", total_iterations=TOTAL), opt, TOTAL) == [BASE] * TOTAL
    opt, ref = optimizer(), optimizer()
    ours = lrs(build_scheduler(opt, "constant", total_iterations=TOTAL, warmup_iterations=4), opt, TOTAL)
    reference = lrs(SequentialLR(ref, [LinearLR(ref, start_factor=1 / 5, end_factor=1.0, total_iters=4),
                                       ConstantLR(ref, factor=1.0, total_iters=0)], milestones=[4]), ref, TOTAL)
    assert ours == reference
    alone = optimizer()  # LinearLR alone holds too, but its recursion drifts by an ulp
    assert ours == pytest.approx(lrs(LinearLR(alone, 1 / 5, 1.0, 4), alone, TOTAL), rel=1e-12)
    assert ours[:5] == pytest.approx([BASE * k / 5 for k in range(1, 6)], rel=1e-12)
    assert ours[4:] == [ours[4]] * (TOTAL - 4)


def test_step_with_warmup_equals_torch_and_the_formula() -> None:
    warmup, every, gamma = 3, 5, 0.5
    opt, ref = optimizer(), optimizer()
    ours = lrs(build_scheduler(opt, "step", total_iterations=TOTAL, warmup_iterations=warmup,
                               step_every=every, gamma=gamma), opt, TOTAL)
    reference = lrs(SequentialLR(ref, [LinearLR(ref, 1 / (warmup + 1), 1.0, warmup),
                                       StepLR(ref, step_size=every, gamma=gamma)], milestones=[warmup]),
                    ref, TOTAL)
    assert ours == reference
    formula = [BASE * (i + 1) / (warmup + 1) if i < warmup else BASE * gamma ** ((i - warmup) // every)
               for i in range(TOTAL)]
    assert ours == pytest.approx(formula, rel=1e-12)


def test_step_every_defaults_to_a_third_of_the_iterations_after_warmup() -> None:
    opt, ref = optimizer(), optimizer()
    ours = lrs(build_scheduler(opt, "step", total_iterations=32, warmup_iterations=2), opt, 32)
    assert ours == lrs(SequentialLR(ref, [LinearLR(ref, 1 / 3, 1.0, 2), StepLR(ref, 10, 0.1)], [2]), ref, 32)


def test_cosine_with_warmup_equals_torch_then_holds_lr_min() -> None:
    warmup, lr_min = 4, 0.01
    opt, ref = optimizer(), optimizer()
    ours = lrs(build_scheduler(opt, "cosine", total_iterations=TOTAL, warmup_iterations=warmup,
                               lr_min=lr_min), opt, TOTAL + 10)
    reference = lrs(SequentialLR(ref, [LinearLR(ref, 1 / (warmup + 1), 1.0, warmup),
                                       CosineAnnealingLR(ref, T_max=TOTAL - warmup, eta_min=lr_min)],
                                 milestones=[warmup]), ref, TOTAL + 1)
    assert ours[: TOTAL + 1] == reference
    span = TOTAL - warmup
    formula = [BASE * (i + 1) / (warmup + 1) if i < warmup
               else lr_min + (BASE - lr_min) * (1 + math.cos(math.pi * (i - warmup) / span)) / 2
               for i in range(TOTAL + 1)]
    assert ours[: TOTAL + 1] == pytest.approx(formula, rel=1e-9)
    # a worker running past the planned iterations (asynchronous termination) stays at lr_min
    assert ours[TOTAL:] == pytest.approx([lr_min] * 10, rel=1e-9)
    opt = optimizer()
    assert lrs(build_scheduler(opt, "cosine", total_iterations=10), opt, 14)[10:] == [0.0] * 4


# -- the Trainer: one scheduler step per iteration, state continues exactly -----------------
class _Strategy:
    iteration = 0

    def quiesce(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"iteration": self.iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = state["iteration"]


class _Engine:
    """A one-process engine with DataParallel's attributes; ``steps=False`` plays a
    parameter server's worker, whose optimizer never steps."""

    def __init__(self, module: nn.Module, opt: torch.optim.Optimizer, steps: bool = True) -> None:
        self.module, self.optimizer, self.strategy, self.steps = module, opt, _Strategy(), steps

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def step(self) -> None:
        if self.steps:
            self.optimizer.step()


def make_trainer(schedule: str, steps: bool = True, **options: Any) -> tuple[Trainer, nn.Module]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=BASE, momentum=0.9)
    scheduler = build_scheduler(opt, schedule, total_iterations=12, **options)
    return Trainer(_Engine(model, opt, steps), nn.CrossEntropyLoss(), PhaseTimer(), scheduler=scheduler), model


def data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


def test_trainer_state_dict_continues_the_schedule_exactly() -> None:
    trainer, model = make_trainer("cosine", warmup_iterations=3, lr_min=0.02)
    used, state = [], None
    for i in range(12):
        trainer.step(*data(i))
        used.append(trainer.lr)
        if i == 4:
            state = trainer.state_dict()
    assert state is not None and state["scheduler"]["last_epoch"] == 5
    fresh, fresh_model = make_trainer("cosine", warmup_iterations=3, lr_min=0.02)
    fresh.load_state_dict(state)
    resumed = []
    for i in range(5, 12):
        fresh.step(*data(i))
        resumed.append(fresh.lr)
    assert resumed == used[5:]
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_state_of_another_schedule_is_refused() -> None:
    trainer, _ = make_trainer("step", warmup_iterations=2)
    trainer.step(*data(0))
    other, _ = make_trainer("cosine", warmup_iterations=2)
    with pytest.raises(ValueError, match="--lr-schedule"):
        other.load_state_dict(trainer.state_dict())


def test_a_rank_whose_optimizer_never_steps_follows_the_schedule_quietly() -> None:
    """ps_grad's workers: the server alone steps its optimizer; every rank's lr agrees."""
    server, _ = make_trainer("step", warmup_iterations=2, step_every=3, gamma=0.5)
    worker, _ = make_trainer("step", steps=False, warmup_iterations=2, step_every=3, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(10):
            server.step(*data(i))
            worker.step(*data(i))
            assert worker.lr == server.lr


@pytest.mark.parametrize(
    "args,words",
    [
        (["--lr-gamma", "0", "--lr-schedule", "step"], ["--lr-gamma", "0", "(0, 1]"]),
        (["--lr-min", "1", "--lr-schedule", "cosine"], ["--lr-min", "1", "[0, --lr 0.05]"]),
        (["--warmup-iterations", "-1"], ["--warmup-iterations", "-1", "negative"]),
        (["--warmup-iterations", "12", "--iterations", "12"], ["--warmup-iterations", "12", "fewer"]),
        (["--lr-step-every", "0"], ["--lr-step-every", "0", "at least 1"]),
        (["--eval-every", "-2"], ["--eval-every", "-2", "negative"]),
        (["--lr-gamma", "0.5"], ["--lr-gamma", "0.5", "--lr-schedule step only", "leave --lr-gamma out"]),
        (["--lr-schedule", "step", "--lr-min", "0.01"], ["--lr-min", "0.01", "--lr-schedule cosine only"]),
    ],
)
def test_bad_schedule_and_eval_options_name_option_value_and_rule(args: list[str], words: list[str], capsys) -> None:
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, (word, err)


def test_unknown_schedule_is_an_argparse_choice_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["train", "--lr-schedule", "linear"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--lr-schedule" in err and "linear" in err and "cosine" in err


def test_an_extended_resume_of_a_schedule_drawn_over_the_run_is_refused_with_the_fix() -> None:
    from types import SimpleNamespace

    from shmtrain.runtime.train.schedule import extended_resume

    cosine = SimpleNamespace(lr_schedule="cosine", lr_step_every=None, lr_min=0.0, warmup_iterations=0)
    text = extended_resume(cosine, 310, 310, 620, "--epochs 20")
    assert text == (
        "--epochs 20: the run's cosine learning-rate schedule was planned over 310 iterations (310 done); it "
        "ended at iteration 310, where the learning rate is --lr-min 0.0, so the 310 iterations to 620 would "
        "not follow a schedule planned for them. Add --restart-schedule to run a new cosine schedule from the "
        "peak --lr over the 310 iterations left (a warm restart), or resume to the planned length (give the "
        "run's own --iterations 310, or leave --iterations/--epochs out)")
    warm = SimpleNamespace(lr_schedule="cosine", lr_step_every=None, lr_min=0.0, warmup_iterations=20)
    assert "a new cosine schedule over the 310 iterations left (a warm restart: its --warmup-iterations 20 " \
           "warm-up again, then from the peak --lr)" in extended_resume(warm, 310, 310, 620, "--epochs 20")
    assert extended_resume(cosine, 310, 310, 310, "--epochs 15") is None  # the planned length
    assert extended_resume(SimpleNamespace(lr_schedule="constant", lr_step_every=None), 10, 10, 20, "") is None
    assert extended_resume(SimpleNamespace(lr_schedule="step", lr_step_every=5), 10, 10, 20, "") is None
    assert "decays are spaced by a third of 10" in extended_resume(
        SimpleNamespace(lr_schedule="step", lr_step_every=None, warmup_iterations=0), 10, 4, 20, "--iterations 20")


@pytest.mark.slow  # three runs (74 s on the loaded 2-core VM; a few seconds idle)
@pytest.mark.timeout(150)
def test_a_finished_cosine_run_resumed_longer_is_refused_then_restarted(tmp_path, capsys) -> None:
    import json

    out = str(tmp_path / "run")
    common = ["--no-progress"]
    assert main(["train", "--strategy", "single", "--workers", "1", "--model", "mlp", "--iterations", "6",
                 "--lr-schedule", "cosine", "--out", out, *common]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", out, "--iterations", "10", *common]) == 2
    err = capsys.readouterr().err
    assert "cosine learning-rate schedule was planned over 6 iterations (6 done); it ended at iteration 6, " \
           "where the learning rate is --lr-min 0.0" in err and "Add --restart-schedule" in err
    assert main(["train", "--resume", out, "--iterations", "10", "--restart-schedule", *common]) == 0
    rows = [json.loads(line) for line in open(f"{out}/metrics/rank-0.jsonl") if '"eval"' not in line]
    lrs = {r["iteration"]: r["lr"] for r in rows}
    assert lrs[7] == pytest.approx(0.05) and 0 < lrs[10] < lrs[8] < lrs[7]  # a new cosine over 4 iterations
