"""A worker killed during a synchronous run is replaced in place: the others never exit,
and the run ends with the weights of a run that was never killed, bit for bit
(``runtime/run/recovery.py``, ``runtime/launch/replacement.py``)."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import pytest

from conftest import worker_process
from support.runs import LONG, iterations_logged, rows_written, start, train, wait_for, weights

pytestmark = pytest.mark.timeout(300)

#: three workers, so a death leaves two survivors (one may be a step ahead of the other)
JOB = [*LONG[:LONG.index("--workers")], "--workers", "3", *LONG[LONG.index("--workers") + 2:]]


#: ``--overlap`` and diloco's host-sync recover as plain ssgd does (a replica's own state): slow
@pytest.fixture(scope="module", params=[
    pytest.param([], id="ssgd"), pytest.param(["--overlap"], id="overlap", marks=pytest.mark.slow),
    pytest.param(["--sharded-update"], id="sharded"), pytest.param(["--strategy", "gpi"], id="gpi"),
    pytest.param(["--strategy", "ps_grad"], id="ps_grad"),
    pytest.param(["--strategy", "diloco", "--inner", "host-sync"], id="diloco-host-sync", marks=pytest.mark.slow)])
def straight(request, tmp_path_factory) -> tuple[list[str], Path]:
    """The run that is never killed, which the killed ones must equal."""
    run = tmp_path_factory.mktemp("straight") / "run"
    assert train(*JOB, *request.param, "--out", str(run)) == 0
    return request.param, run


def test_a_killed_worker_is_replaced_and_the_weights_are_those_of_the_straight_run(straight, tmp_path: Path) -> None:
    flags, reference = straight
    run = tmp_path / "run"
    launcher = start([*JOB, *flags, "--max-restarts", "3", "--out", str(run)])
    survivors = {rank: worker_process(launcher.pid, rank).pid for rank in (0, 1, 2)}
    chosen = random.Random(os.getpid()).sample([0, 1, 2], 2)
    killed = []
    for n, victim in enumerate(chosen):  # two deaths, at points of a step the clock chooses
        wait_for(lambda n=n: rows_written(run, 0) > 600 * (n + 1), launcher, f"iteration {600 * (n + 1)}")
        process = worker_process(launcher.pid, victim)
        os.kill(process.pid, signal.SIGKILL)
        killed.append(victim)
        survivors.pop(victim, None)
    wait_for(lambda: rows_written(run, 0) > 1500, launcher, "iteration 1500")
    for rank, pid in survivors.items():  # a rank never killed runs in its first process still
        assert worker_process(launcher.pid, rank).pid == pid, rank
    _, err = launcher.communicate(timeout=240)
    assert launcher.returncode == 0, err
    assert "restarting every worker" not in err, err
    assert err.count("replaced in place") == 2, err
    assert weights(run / "model.pt").keys() == weights(reference / "model.pt").keys()
    for key, value in weights(reference / "model.pt").items():
        assert weights(run / "model.pt")[key].equal(value), key  # bit for bit
    for rank in (0, 1, 2):  # every iteration once (a replacement may mark one row lost)
        assert iterations_logged(run, rank) == list(range(1, 3001)), rank
    assert not list((run / "checkpoints").glob("step-*.tmp"))  # a save the death cut short is gone


def test_a_killed_cpu_acc_worker_is_replaced_and_the_weights_are_those_of_the_straight_run(tmp_path: Path) -> None:
    """cpu_acc: every worker applies the same update once the host's accumulation is
    complete, so a death is recovered as under ssgd. Two workers: the accumulator threads
    add in the order the gradients arrive, and a sum of two terms is the same either way,
    so the run is reproducible bit for bit (with three it is not: two straight runs differ
    in rounding, by as much as one step more or less would)."""
    job = [*JOB[:JOB.index("--workers")], "--workers", "2", *JOB[JOB.index("--workers") + 2:], "--strategy", "cpu_acc"]
    straight, run = tmp_path / "straight", tmp_path / "run"
    assert train(*job, "--out", str(straight)) == 0
    victims = tuple(random.Random(os.getpid()).choice([0, 1]) for _ in range(2))
    _kill_in_turn([*job, "--max-restarts", "3", "--out", str(run)], run, victims, 600, workers=2)
    for rank in (0, 1):
        assert iterations_logged(run, rank) == list(range(1, 3001)), rank
    for key, value in weights(straight / "model.pt").items():
        assert weights(run / "model.pt")[key].equal(value), key  # bit for bit


def test_a_killed_asynchronous_worker_is_replaced_from_the_global_weights(tmp_path: Path) -> None:
    """seasgd: the master (rank 0, which holds W_g's buffer service) and another worker
    killed; each is replaced from W_g, the others go on from their own state, and every
    rank's metrics hold each iteration once, none lost."""
    import json

    run = tmp_path / "run"
    job = [*JOB, "--strategy", "seasgd", "--max-restarts", "3", "--out", str(run)]
    _kill_in_turn(job, run, (0, 2), 600)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["lost_workers"] == {} and summary["accuracy"] > 0.3, summary  # W_g trained on (10 classes)


def test_a_killed_hsgd_worker_is_replaced_from_its_group(tmp_path: Path) -> None:
    """hsgd, 2 groups of 2: the master (group 0's root) killed, then a member of group 1;
    each replacement starts from its group's survivor (the group's weights), the other
    group goes on from its own state, and every rank's rows hold each iteration once."""
    run = tmp_path / "run"
    job = [*JOB[:JOB.index("--workers")], "--workers", "4", *JOB[JOB.index("--workers") + 2:],
           "--strategy", "hsgd", "--groups", "2", "--max-restarts", "3", "--out", str(run)]
    _kill_in_turn(job, run, (0, 3), 400, workers=4)


def _kill_in_turn(job: list[str], run: Path, victims: tuple[int, ...], every: int, workers: int = 3) -> None:
    """Run ``job``, kill each of ``victims`` once rank 1 has logged ``every`` more rows;
    the run ends 0, each death replaced in place, every rank's rows each iteration once."""
    launcher = start(job)
    for n, victim in enumerate(victims):
        wait_for(lambda n=n: rows_written(run, 1) > every * (n + 1), launcher, f"iteration {every * (n + 1)}")
        os.kill(worker_process(launcher.pid, victim).pid, signal.SIGKILL)
    _, err = launcher.communicate(timeout=240)
    assert launcher.returncode == 0, err
    assert err.count("replaced in place") == len(victims) and "restarting every worker" not in err, err
    for rank in range(workers):
        logged = iterations_logged(run, rank)
        assert logged == list(range(1, len(logged) + 1)) and len(logged) >= every * len(victims), rank
