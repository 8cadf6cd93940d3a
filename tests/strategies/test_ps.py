"""Parameter servers: ps_grad equals single-process SGD on the union batch (eq. 2.1),
ps_weight equals a re-implementation of eq. 2.2 step by step; one host and two hosts."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shmtrain.fabric.exchanges.star import average_, open_star
from shmtrain.fabric.shm.segment import PREFIX, sweep
from shmtrain.fabric.trust import bound_store
from shmtrain.parallel.data_parallel import DataParallel, make_config
from shmtrain.runtime.launch.job_dir import JobDir
from shmtrain.runtime.launch.launcher import WorkerFailed, launch

IN, HIDDEN, OUT = 6, 16, 4


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def data(steps: int, batch: int, world: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = steps * batch * world
    return torch.randn(n, IN, generator=gen), torch.randint(0, OUT, (n,), generator=gen)


def shard(x, y, step: int, rank: int, batch: int, world: int):
    start = (step * world + rank) * batch
    return x[start: start + batch], y[start: start + batch]


def flat(net: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def optimizer(net: nn.Module, p: dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=p["lr"], momentum=p.get("momentum", 0.0),
                           weight_decay=p.get("weight_decay", 0.0))


def train_worker(ctx, p: dict[str, Any]) -> dict[str, Any]:
    """Train with DataParallel(strategy) ``p["repeat"]`` times in a row (fresh instances
    reuse the channels); weights after every step, and the timer rows."""
    x, y = data(p["steps"], p["batch"], ctx.world_size)
    runs = []
    for _ in range(p.get("repeat", 1)):
        net = model()
        dp = DataParallel(net, optimizer(net, p), p["strategy"], ctx=ctx, **p.get("options", {}))
        history, rows = [], []
        for step in range(p["steps"]):
            xs, ys = shard(x, y, step, ctx.rank, p["batch"], ctx.world_size)
            dp.zero_grad()
            nn.functional.cross_entropy(dp(xs), ys).backward()
            dp.step()
            history.append(flat(net))
            rows.append(dp.timer.finish_iteration())
        dp.close()
        runs.append({"history": history, "final": flat(net), "rows": rows})
    return {"runs": runs}


def union_sgd(p: dict[str, Any], world: int) -> list[torch.Tensor]:
    """Eq. 2.1 reference: one process, SGD on the union of the workers' batches."""
    net = model()
    opt = optimizer(net, p)
    x, y = data(p["steps"], p["batch"], world)
    history = []
    for step in range(p["steps"]):
        g = p["batch"] * world
        opt.zero_grad()
        nn.functional.cross_entropy(net(x[step * g:(step + 1) * g]), y[step * g:(step + 1) * g]).backward()
        opt.step()
        history.append(flat(net))
    return history


def weight_averaging(p: dict[str, Any], world: int, interval: int) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """Eq. 2.2 re-implemented on flat vectors: w_i <- SGD step of worker i (own momentum
    buffer, weight decay); every ``interval`` steps w_i <- (1/N) sum_j w_j; a last average
    if the run does not end on one. Returns per step the weights of every worker, and the
    final weights."""
    net = model()
    start = flat(net)
    weights = [start.clone() for _ in range(world)]
    buffers: list[torch.Tensor | None] = [None] * world
    x, y = data(p["steps"], p["batch"], world)
    lr, mom, wd = p["lr"], p.get("momentum", 0.0), p.get("weight_decay", 0.0)
    history = []
    for step in range(p["steps"]):
        for i in range(world):
            torch.nn.utils.vector_to_parameters(weights[i], net.parameters())
            net.zero_grad()
            xs, ys = shard(x, y, step, i, p["batch"], world)
            nn.functional.cross_entropy(net(xs), ys).backward()
            g = torch.cat([q.grad.reshape(-1) for q in net.parameters()]) + wd * weights[i]
            buffers[i] = g.clone() if buffers[i] is None or mom == 0 else mom * buffers[i] + g
            weights[i] = weights[i] - lr * buffers[i]
        if (step + 1) % interval == 0:
            mean = torch.stack(weights).mean(0)
            weights = [mean.clone() for _ in range(world)]
        history.append([w.clone() for w in weights])
    final = torch.stack(weights).mean(0) if p["steps"] % interval else weights[0]
    return history, final


@pytest.mark.parametrize("workers,transport", [
    pytest.param(2, "shm", marks=pytest.mark.slow), pytest.param(3, "shm", marks=pytest.mark.slow),
    (4, "shm"), (3, "gloo"),
])
def test_ps_grad_equals_single_process_sgd_on_the_union_batch(workers: int, transport: str) -> None:
    p = {"strategy": "ps_grad", "steps": 8, "batch": 5, "lr": 0.2, "momentum": 0.9, "weight_decay": 1e-3,
         "options": {"ps_transport": transport}, "repeat": 2}
    reference = union_sgd(p, workers)
    results = launch("strategies.test_ps:train_worker", workers, p, timeout=90)
    for rank, result in enumerate(results):
        for run in result["runs"]:  # the second instance reuses the first one's channels
            for step in range(p["steps"]):
                assert rel(run["history"][step], reference[step]) < 1e-5, (rank, step)
    assert rel(reference[0], reference[-1]) > 1e-2  # the weights moved: not a trivial match
    server_rows = results[0]["runs"][0]["rows"]
    for row in server_rows:
        assert {"gather", "average", "broadcast", "comm"} <= set(row)
        assert row["comm"] == pytest.approx(row["gather"] + row["average"] + row["broadcast"])
    if transport == "shm":
        assert "average" not in results[1]["runs"][0]["rows"][0]  # only the server averages


def test_ps_weight_interval_1_plain_sgd_is_eq_2_2_step_by_step() -> None:
    workers = 3
    p = {"strategy": "ps_weight", "steps": 8, "batch": 4, "lr": 0.3, "options": {"average_interval": 1}}
    reference, _ = weight_averaging(p, workers, 1)
    results = launch("strategies.test_ps:train_worker", workers, p, timeout=90)
    for rank, result in enumerate(results):
        for step in range(p["steps"]):
            assert rel(result["runs"][0]["history"][step], reference[step][rank]) < 1e-5, (rank, step)
    assert rel(reference[0][0], reference[-1][0]) > 1e-2


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_ps_weight_local_sgd_with_momentum_matches_its_reimplementation(transport: str) -> None:
    workers, interval = 2, 3
    p = {"strategy": "ps_weight", "steps": 7, "batch": 4, "lr": 0.2, "momentum": 0.9, "weight_decay": 1e-3,
         "options": {"average_interval": interval, "ps_transport": transport}}
    reference, final = weight_averaging(p, workers, interval)
    results = launch("strategies.test_ps:train_worker", workers, p, timeout=90)
    for rank, result in enumerate(results):
        run = result["runs"][0]
        for step in range(p["steps"]):
            assert rel(run["history"][step], reference[step][rank]) < 1e-5, (rank, step)
        assert rel(run["final"], final) < 1e-5  # the last round in finish()
    # between averages the workers differ: this is local SGD, not gradient averaging
    assert rel(reference[0][0], reference[0][1]) > 1e-4
    rows = results[0]["runs"][0]["rows"]
    assert "gather" not in rows[0] and "gather" in rows[interval - 1]


def test_bad_options_are_clear_errors() -> None:
    for value in (0, -2):
        with pytest.raises(ValueError, match="--average-interval .* must be >= 1"):
            make_config("ps_weight", {"average_interval": value})
    with pytest.raises(ValueError, match="--average-interval"):
        make_config("ps_weight", {"average_interval": 1.5})
    with pytest.raises(ValueError, match="--ps-transport 'mpi'"):
        make_config("ps_grad", {"ps_transport": "mpi"})
    with pytest.raises(ValueError, match="--average-interval does not apply to --strategy ps_grad"):
        make_config("ps_grad", {"average_interval": 2})
    with pytest.raises(ValueError, match="--ps-transport 'mpi' .*shm or gloo"):
        open_star(None, "mpi", "ps_grad", 4, torch.float32, torch.zeros(4))


def test_average_in_place_and_into_another_buffer() -> None:
    inputs = [torch.full((100_000,), float(v)) for v in (1, 2, 3, 6)]
    out = torch.empty(100_000)
    assert torch.equal(average_(out, inputs), torch.full((100_000,), 3.0))
    average_(inputs[2], inputs)  # the output is one of the inputs
    assert torch.equal(inputs[2], torch.full((100_000,), 3.0))
    with pytest.raises(ValueError):
        average_(out, [])


def resume_worker(ctx, p: dict[str, Any]) -> dict[str, Any]:
    """Per (strategy, transport): ``steps`` iterations straight, and ``steps // 2``, a
    checkpoint (model, optimizer, strategy), a fresh model, optimizer and strategy (other
    initial weights) that load it, and the remaining iterations."""
    x, y = data(p["steps"], p["batch"], ctx.world_size)
    half = p["steps"] // 2

    def train(dp: DataParallel, steps: range) -> None:
        for step in steps:
            xs, ys = shard(x, y, step, ctx.rank, p["batch"], ctx.world_size)
            dp.zero_grad()
            nn.functional.cross_entropy(dp(xs), ys).backward()
            dp.step()

    out = {}
    for name, options in p["runs"].items():
        strategy = name.split(":")[0]
        net = model()
        dp = DataParallel(net, optimizer(net, p), strategy, ctx=ctx, **options)
        train(dp, range(p["steps"]))
        straight, straight_state = flat(net), dp.strategy.state_dict()
        dp.close()

        net = model()
        opt = optimizer(net, p)
        dp = DataParallel(net, opt, strategy, ctx=ctx, **options)
        train(dp, range(half))
        dp.strategy.quiesce()
        checkpoint = io.BytesIO()
        torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
                    "strategy": dp.strategy.state_dict()}, checkpoint)
        dp.close()  # ps_weight: off an averaging round, close() averages once more

        net = model(seed=7)
        fresh = flat(net)  # (ps_grad shm: the weights are shared once wrapped, so read them here)
        opt = optimizer(net, p)
        dp = DataParallel(net, opt, strategy, ctx=ctx, **options)
        checkpoint.seek(0)
        state = torch.load(checkpoint, weights_only=True)
        with torch.no_grad():
            net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        dp.strategy.load_state_dict(state["strategy"])
        server = dp.strategy.star.server.clone()
        loaded = flat(net)
        train(dp, range(half, p["steps"]))
        out[name] = {"straight": straight, "resumed": flat(net), "fresh": fresh, "loaded": loaded,
                     "server": server, "straight_state": straight_state,
                     "resumed_state": dp.strategy.state_dict()}
        dp.close()
    return out


def test_a_run_resumed_from_its_state_equals_the_run_straight_through() -> None:
    """State contract: model + optimizer + strategy.state_dict() after N/2 iterations, in a
    fresh strategy, continue exactly (ps_weight: checkpoint between two averages)."""
    p = {"steps": 6, "batch": 4, "lr": 0.2, "momentum": 0.9, "weight_decay": 1e-3,
         "runs": {"ps_grad": {"ps_transport": "shm"},
                  "ps_weight": {"ps_transport": "shm", "average_interval": 2},
                  "ps_grad:gloo": {"ps_transport": "gloo"},
                  "ps_weight:gloo": {"ps_transport": "gloo", "average_interval": 2}}}
    results = launch("strategies.test_ps:resume_worker", 2, p, timeout=120)
    for name in p["runs"]:
        weights_of_rank0 = results[0][name]["loaded"]
        for rank, result in enumerate(results):
            run = result[name]
            assert rel(run["resumed"], run["straight"]) < 1e-6, (name, rank)
            assert run["resumed_state"] == run["straight_state"], (name, rank)
            assert rel(run["fresh"], run["loaded"]) > 1e-2  # the load did replace the weights
            assert torch.equal(run["server"], weights_of_rank0), (name, rank)  # rank 0's everywhere
            assert rel(run["straight"], run["fresh"]) > 1e-2
        if name.startswith("ps_weight"):
            assert results[0][name]["straight_state"]["rounds"] == 3
            # the checkpoint is between two averages: the workers' weights differ there
            assert rel(results[0][name]["loaded"], results[1][name]["loaded"]) > 1e-4


def failing_worker(ctx, p: dict[str, Any]) -> None:
    net = model()
    dp = DataParallel(net, optimizer(net, p), p["strategy"], ctx=ctx)
    x, y = data(4, 2, ctx.world_size)
    for step in range(4):
        if ctx.rank == 1 and step == 2:
            raise RuntimeError("worker 1 breaks on purpose")
        dp.zero_grad()
        nn.functional.cross_entropy(dp(x[:2]), y[:2]).backward()
        dp.step()


@pytest.mark.parametrize("strategy", ["ps_grad", "ps_weight"])
def test_a_failing_worker_ends_the_job_instead_of_hanging(strategy: str) -> None:
    start = time.monotonic()
    with pytest.raises(WorkerFailed):
        launch("strategies.test_ps:failing_worker", 2, {"strategy": strategy, "lr": 0.1}, timeout=60)
    assert time.monotonic() - start < 45


def test_bench_ps_writes_a_row_per_strategy_transport_and_worker_count(tmp_path: Path) -> None:
    from shmtrain.bench.ps import plot, run

    rows = run([2], ["ps_grad", "ps_weight"], ["shm", "gloo"], numel=4096, iterations=3, warmup=1,
               log=lambda *_: None)
    assert {(r["strategy"], r["transport"]) for r in rows} == {
        ("ps_grad", "shm"), ("ps_grad", "gloo"), ("ps_weight", "shm"), ("ps_weight", "gloo")}
    for row in rows:
        assert row["average_ms"] > 0 and row["comm_ms"] >= row["gather_ms"] and row["bcast_wait_ms"] is not None
    plot(rows, tmp_path / "ps.png")
    assert (tmp_path / "ps.png").stat().st_size > 1000


# -- two hosts on one machine: 2 x 2 workers, torchrun's environment ---------------------

def run_two_hosts(target: str, payload: Any, per_host: int = 2, timeout: float = 100.0) -> list[Any]:
    world = 2 * per_host
    store = bound_store("127.0.0.1", timeout=timeout, world_size=world + 1)
    job = JobDir.make()
    job.put_payload(payload)
    procs = []
    try:
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_host),
                       LOCAL_WORLD_SIZE=str(per_host), GROUP_RANK=str(rank // per_host),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), SHMTRAIN_STORE_PORT=str(store.port),
                       SHMTRAIN_JOB_DIR=str(job.path), SHMTRAIN_TIMEOUT="60", OMP_NUM_THREADS="1")
            env.pop("SHMTRAIN_CONTROL", None)
            procs.append(subprocess.Popen([sys.executable, "-m", "shmtrain.runtime.launch.worker", target], env=env))
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.wait(max(1.0, deadline - time.monotonic()))
        codes = [proc.returncode for proc in procs]
        assert codes == [0] * world, f"worker exit codes {codes}"
        return [job.result(r) for r in range(world)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if store.check(["run_id"]):
            sweep(f"{PREFIX}-{store.get('run_id').decode()}")
        job.remove()


def two_strategies_worker(ctx, p: dict[str, Any]) -> dict[str, Any]:
    assert ctx.num_nodes == 2 and ctx.leaders is not None
    out = {}
    for name, options in p["runs"].items():
        q = dict(p, strategy=name.split(":")[0], options=options)
        out[name] = train_worker(ctx, q)["runs"][0]
    return out


@pytest.mark.parametrize("transport", ["shm", pytest.param("gloo", marks=pytest.mark.slow)])
def test_two_hosts_of_two_workers_equal_the_references(transport: str) -> None:
    """shm: shared memory in each host, gloo gather/broadcast between the host leaders.
    (gloo: the same code path as on one host, hence slow-marked.)"""
    p = {"steps": 6, "batch": 3, "lr": 0.2, "momentum": 0.9, "weight_decay": 1e-3,
         "runs": {"ps_grad": {"ps_transport": transport},
                  "ps_weight": {"ps_transport": transport, "average_interval": 2}}}
    grad_ref = union_sgd(p, 4)
    weight_ref, _ = weight_averaging(p, 4, 2)
    results = run_two_hosts("strategies.test_ps:two_strategies_worker", p)
    for rank, result in enumerate(results):
        for step in range(p["steps"]):
            assert rel(result["ps_grad"]["history"][step], grad_ref[step]) < 1e-5, (rank, step)
            assert rel(result["ps_weight"]["history"][step], weight_ref[step][rank]) < 1e-5, (rank, step)
