"""``shmtrain bench hosts``: time to accuracy across two namespaced hosts.

The quick variant runs the methods on two network namespaces joined by a veth pair
shaped to 1 Gbit; it needs root and ``ip netns`` and skips with the reason elsewhere
(like ``tests/runtime/hosts/test_netns.py``). No namespace may be left behind. The rows' arithmetic
(per-host numbers, medians, the grid's choice, the rotation, the one-host verdict) is
checked on written metrics files, without hosts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shmtrain.bench.hosts import command as hosts

pytestmark = pytest.mark.timeout(240)


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


@pytest.mark.parametrize("methods", [
    pytest.param(["ssgd"], marks=pytest.mark.slow),  # ~30 s of CPU; the rows' sums by default below
    pytest.param(None, marks=pytest.mark.slow),  # every default method, ddp included (~50 s)
])
def test_quick_bench_gives_every_method_a_time_to_accuracy(tmp_path: Path, methods: list[str] | None) -> None:
    reason = hosts.why_not("1gbit")
    if reason:
        pytest.skip(reason)
    out, doc_file, png = tmp_path / "runs", tmp_path / "hosts.json", tmp_path / "hosts.png"
    chosen = ["--methods", *methods] if methods else []
    proc = subprocess.run([sys.executable, "-m", "shmtrain", "bench", "hosts", "--quick", "--out", str(out),
                           "--json", str(doc_file), "--plot", str(png), *chosen],
                          capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(doc_file.read_text())
    assert [row["method"] for row in doc["rows"]] == (methods or hosts.DEFAULT_METHODS)
    for row in doc["rows"]:
        for key in ("time_to_target_s", "train_time_to_target_s", "final_accuracy", "comm_ms", "startup_s"):
            assert isinstance(row[key], int | float) and row[key] >= 0, (row["method"], key, row[key])
        assert row["final_accuracy"] >= doc["settings"]["target"], row
        assert row["iterations"] >= 1 and row["comm_ms"] > 0 and row["runs"][0]["curve"], row
    assert "s to target" in proc.stdout and all(m in proc.stdout for m in methods or hosts.DEFAULT_METHODS)
    assert png.stat().st_size > 0
    assert len(doc["namespaces"]) == 2 and not set(doc["namespaces"]) & _namespaces(), "a namespace was left behind"


def test_without_root_it_says_why_instead_of_a_traceback(monkeypatch, capsys) -> None:
    from shmtrain.cli import main

    monkeypatch.setattr(hosts.os, "geteuid", lambda: 1000)
    assert main(["bench", "hosts", "--quick", "--methods", "ssgd"]) == 2
    err = capsys.readouterr().err
    assert "shmtrain: error: bench hosts cannot make two hosts here: network namespaces need root" in err
    assert "Traceback" not in err


def test_an_unknown_method_or_rate_is_refused(capsys) -> None:
    from shmtrain.cli import main

    assert main(["bench", "hosts", "--methods", "ssgd", "nccl"]) == 2
    assert f"--methods ['nccl']: unknown; choose from {', '.join(hosts.METHODS)}" in capsys.readouterr().err
    assert main(["bench", "hosts", "--rate", "fast"]) == 2
    assert "--rate 'fast'" in capsys.readouterr().err
    assert main(["bench", "hosts", "--setting", "mlp-100mbit", "--grid-point", "4"]) == 2
    assert "--grid-point 4: the grid has 3 points per method; give 1 to 3" in capsys.readouterr().err


def _write_run(folder: Path, ranks: dict[int, list[tuple[float, int]]], evals: list[dict]) -> None:
    """A run folder as a job leaves it: per rank, rows (t0, iteration); rank 0's evals."""
    (folder / "metrics").mkdir(parents=True)
    for rank, rows in ranks.items():
        lines = [json.dumps({"iteration": it, "loss": 1.0, "t0": t0,
                             "time": {"compute": 0.01, "comm": 0.03, "iteration": 0.04}}) for t0, it in rows]
        if rank == 0:
            lines += [json.dumps({"eval": e}) for e in evals]
        (folder / "metrics" / f"rank-{rank}.jsonl").write_text("\n".join(lines) + "\n")


def test_a_row_gives_per_host_iterations_startups_link_bytes_and_the_global_curve(tmp_path: Path) -> None:
    from shmtrain.bench.hosts.rows import summarize

    start = 1000.0
    ranks = {0: [(1003.0, 1), (1003.1, 2), (1003.2, 3), (1003.3, 4)],
             1: [(1003.05, 1), (1003.2, 2), (1003.3, 3), (1003.4, 4)],
             2: [(1004.0, 1), (1004.5, 2)], 3: [(1004.2, 1), (1004.6, 2)]}  # host b: later, fewer
    evals = [{"iteration": 2, "accuracy": 0.4, "t0": 1003.15, "weights": "global"},
             {"iteration": 4, "accuracy": 0.8, "t0": 1003.35, "weights": "global"}]
    _write_run(tmp_path / "run", ranks, evals)
    row = summarize("seasgd", tmp_path / "run", start, 5.0, 0.75, link=3_000_000, per_node=2)
    assert row["evaluated"] == "global"
    assert row["time_to_target_s"] == pytest.approx(3.35) and row["iterations_to_target"] == 4
    assert row["train_time_to_target_s"] == pytest.approx(0.35)  # after host a's first iteration
    assert row["best_accuracy"] == 0.8 and row["final_accuracy"] == 0.8
    assert row["iterations_per_rank"] == [4, 4, 2, 2] and row["iterations_per_host"] == [4, 2]
    assert row["startup_per_host_s"] == [3.0, 4.0] and row["startup_s"] == 4.0  # the later host
    assert row["link_mb"] == 3.0 and row["link_kb_per_iteration"] == pytest.approx(1000.0)  # 3 MB / 3 iterations
    assert row["comm_share"] == pytest.approx(0.75)


def test_rounds_give_medians_and_the_grid_point_that_reached_the_target_soonest() -> None:
    from shmtrain.bench.hosts.rows import combine, pick, rotated

    def run(t: float | None, best: float, startups: list[float]) -> dict:
        return {"time_to_target_s": t, "train_time_to_target_s": t, "best_accuracy": best, "final_accuracy": best,
                "iterations": 10, "iterations_per_host": [10, 4], "startup_per_host_s": startups, "link_mb": 2.0}

    row = combine("diloco", [run(9.0, 0.9, [3, 4]), run(7.0, 0.92, [2, 5]), run(8.0, 0.91, [4, 3])],
                  {"grid_point": {"lr": 0.05}})
    assert row["time_to_target_s"] == 8.0 and row["time_to_target_range_s"] == [7.0, 9.0] and row["reached"] == 3
    assert row["startup_per_host_s"] == [3, 4] and row["iterations_per_host"] == [10, 4]
    assert row["grid_point"] == {"lr": 0.05} and row["best_accuracy"] == 0.91
    missed = combine("hsgd", [run(9.0, 0.9, [3, 4]), run(None, 0.7, [3, 4])])
    assert missed["time_to_target_s"] is None and missed["reached"] == 1  # a median only when every round reached it
    trials = [({"lr": 0.02}, run(None, 0.85, [])), ({"lr": 0.05}, run(12.0, 0.9, [])),
              ({"lr": 0.1}, run(10.0, 0.9, []))]
    assert pick(trials) == {"lr": 0.1}
    assert pick([({"lr": 0.02}, run(None, 0.6, [])), ({"lr": 0.1}, run(None, 0.7, []))]) == {"lr": 0.1}
    assert [rotated(["a", "b", "c"], r) for r in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                               ["a", "b", "c"]]
    assert hosts.grid_points({"lr": [0.1, 0.2], "batch_size": [8]}) == [{"lr": 0.1, "batch_size": 8},
                                                                         {"lr": 0.2, "batch_size": 8}]
    # a grid point's method flags reach the command line last (they win), the bench's own keys do not
    settings = dict(hosts.DEFAULTS, grid={}, launcher="fork", preload="torchvision", sync_every=10,
                    outer_dtype="bf16")
    words = hosts._worker_command("diloco", settings, Path("/tmp/x"))
    assert words[0] == "train" and words[-4:] == ["--sync-every", "10", "--outer-dtype", "bf16"]
    assert "--preload" not in words and "--launcher" not in words
    assert hosts._worker_command("ddp", settings, Path("/tmp/x"))[:2] == ["-m", "shmtrain.bench.hosts.ddp"]
    assert hosts._worker_command("ssgd", dict(settings, launcher="torchrun"), Path("/tmp/x"))[:3] == [
        "-m", "shmtrain", "train"]


def test_the_one_host_verdict_and_the_written_down_settings() -> None:
    below = {"method": "one-host", "reached": 0, "rounds": 3, "best_accuracy": 0.52}
    assert "one host alone cannot reach 90%: best held-out accuracy 0.5200" in hosts.one_host_verdict([below], 0.9)
    assert "does not need both hosts" in hosts.one_host_verdict([dict(below, reached=3)], 0.9)
    assert hosts.one_host_verdict([{"method": "ssgd"}], 0.9) is None
    for name, preset in hosts.SETTINGS.items():  # every method tuned on the same grid, a class split, one host
        assert preset["class_split"] == 2 and hosts.ONE_HOST in preset["methods"], name
        assert set(preset["methods"]) >= {"ssgd", "hsgd", "seasgd", "diloco", "hybrid", "ddp"}, name
        assert {len(hosts.method_points(preset["grid"], m)) for m in preset["methods"]} == {3}, name  # one budget
        assert hosts.method_points(preset["grid"], "ddp") == hosts.method_points(preset["grid"], hosts.ONE_HOST)
    with pytest.raises(ValueError, match="different budgets"):
        hosts._budget({"*": [{"lr": 0.1}], "diloco": [{"lr": 0.1}, {"lr": 0.2}]}, ["ddp", "diloco"])


def test_every_grid_point_of_the_diloco_methods_is_a_valid_train_command() -> None:
    """The compressed methods' points leave bf16 out (--compress refuses it beside it), and
    every DiLoCo-family point gives the outer lr, so the tables do not follow the default
    (0.7, DiLoCo's; ResNet-18's compressed points average the hosts' models: 1, no momentum)."""
    from shmtrain.cli import build_parser
    from shmtrain.runtime.config import resolve

    for name, preset in hosts.SETTINGS.items():
        for method in ("diloco", "hybrid", "diloco-topk", "hybrid-topk"):
            for point in hosts.method_points(preset["grid"], method):
                settings = {**hosts.DEFAULTS, **{k: v for k, v in preset.items() if k in hosts.DEFAULTS}, **point}
                words = hosts._worker_command(method, settings, Path("/tmp/x"))
                args = vars(build_parser().parse_args(words))
                config = resolve({k: v for k, v in args.items() if v is not None and k not in ("handler", "command")})
                options = config.strategy_config
                assert options.outer_lr == point["outer_lr"] and options.outer_momentum == point["outer_momentum"]
                assert options.outer_lr in (0.7, 1.0), (name, method, point)  # DiLoCo's, or plain averaging
                assert options.outer_momentum == 0.8 or method.endswith("-topk"), (name, method, point)
                assert (options.compress == "topk:0.01,bits:4") == method.endswith("-topk"), (name, method)
    assert hosts.SETTINGS["mlp-100mbit"]["rate"] == "100mbit" and hosts.SETTINGS["resnet18-1gbit"]["rate"] == "1gbit"


@pytest.mark.parametrize("strategy", [  # ~12-18 s each: W_g (seasgd) and θ (the hybrid) by default
    ["seasgd"], pytest.param(["hsgd", "--groups", "2", "--group-size", "1"], marks=pytest.mark.slow),
    pytest.param(["diloco", "--sync-every", "4"], marks=pytest.mark.slow),
    ["diloco", "--inner", "host-sync", "--sync-every", "4"]])
def test_rank_0_evaluates_the_job_model_of_every_asynchronous_or_hybrid_method(tmp_path: Path,
                                                                             strategy: list[str]) -> None:
    """The curve of bench hosts is the job's model (W_g, DiLoCo's θ^(t)), not rank 0's
    copy: every eval row says so, and the last one is the model.pt the run saves."""
    out = tmp_path / "run"
    from shmtrain.cli import main

    assert main(["train", "--workers", "2", "--iterations", "10", "--eval-every", "4", "--strategy", *strategy,
                 "--no-progress", "--checkpoint-every", "0", "--out", str(out)]) == 0  # in this process
    evals = [json.loads(line)["eval"] for line in (out / "metrics" / "rank-0.jsonl").read_text().splitlines()
             if '"eval"' in line]
    assert evals and all(e.get("weights") == "global" for e in evals), evals
    summary = json.loads((out / "summary.json").read_text())
    assert "accuracy_rank0_local" in summary  # model.pt is the global model, rank 0's own beside it
    if strategy[0] == "diloco":  # deterministic: θ^(t) after the outer step at 8, unchanged at 10
        assert evals[-1]["iteration"] == 10 and evals[-1]["accuracy"] == summary["accuracy"]


def test_the_class_split_gives_each_host_its_classes_shared_by_its_workers() -> None:
    from types import SimpleNamespace

    from shmtrain.runtime.data.class_split import host_classes, shard_sampler
    from shmtrain.runtime.data.tensors import load_digits_data

    data = load_digits_data()
    assert host_classes(10, 2, 0) == [0, 2, 4, 6, 8] and host_classes(10, 3, 4) == [1, 4, 7]
    seen = {}
    for node in (0, 1):
        for local in (0, 1):
            ctx = SimpleNamespace(world_size=4, rank=2 * node + local, node_rank=node, local_world=2,
                                  local_rank=local)
            sampler = shard_sampler(data, 16, 0, ctx, class_split=2)
            steps = sampler.steps_per_epoch
            seen[node, local] = torch.cat([sampler.indices(s) for s in range(steps)])
            assert {int(c) % 2 for c in data.train_y[seen[node, local]]} == {node}  # only its host's classes
    for node in (0, 1):
        a, b = seen[node, 0], seen[node, 1]
        assert not set(a.tolist()) & set(b.tolist())  # the host's workers share its subset, no sample twice
        subset = int((data.train_y % 2 == node).sum())
        assert len(a) + len(b) >= subset - 2 * 16 * 2  # an epoch covers the subset (less a last partial step)
    whole = shard_sampler(data, 16, 0, SimpleNamespace(world_size=4, rank=1), class_split=0)
    assert type(whole).__name__ == "ShardSampler"
    with pytest.raises(ValueError, match="--class-split 11: the data set has 10 classes"):
        host_classes(10, 11, 0)


def test_startup_marks_are_read_back_from_the_logs_per_phase(tmp_path: Path, monkeypatch, capsys) -> None:
    from shmtrain import startup
    from shmtrain.bench.hosts.rows import startup_phases

    monkeypatch.setenv(startup.ENV, "1")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(startup, "_started", False)
    startup.mark("imports")
    err = capsys.readouterr().err
    assert "shmtrain-startup rank=3 t=" in err and err.splitlines()[0].endswith(" process")
    log = tmp_path / "x-node0.log"
    log.write_text("[default0]:shmtrain-startup rank=0 t=100.5 process\nnoise\n"
                   "[default1]:shmtrain-startup rank=1 t=101.0 process\nshmtrain-startup rank=0 t=103.0 imports\n"
                   "shmtrain-startup rank=1 t=103.5 imports\nshmtrain-startup rank=0 t=104.0 strategy\n")
    assert startup_phases([log, tmp_path / "missing.log"], 100.0) == {"process": 1.0, "imports": 3.5, "strategy": 4.0}
    monkeypatch.delenv(startup.ENV)
    startup.mark("gloo")
    assert capsys.readouterr().err == ""  # nothing without the variable


# the digests' logic runs by default in strategies/layout/test_initial_weights.py
@pytest.mark.slow  # ~20 s: one job on two namespaced hosts
def test_on_a_real_link_the_initial_weights_do_not_cross(tmp_path: Path) -> None:
    """wide_mlp (4.5 MB of weights) across two hosts, fewer iterations than H: no outer
    step, so the link carries only the start-up and the results. Every worker built the
    same weights from the seed, so they do not cross (gloo's broadcast of rank 0's sent
    them over the link twice: 9.06 MB)."""
    reason = hosts.why_not("none")
    if reason:
        pytest.skip(reason)
    settings = dict(hosts.DEFAULTS, iterations=6, eval_every=3, target=0.99, launcher="fork")
    doc = hosts.run(["diloco-topk"], settings, "none", tmp_path / "runs", 180.0, log=lambda *a, **k: None)
    row = doc["rows"][0]
    assert row["iterations_per_host"] == [6, 6], row
    assert row["link_mb"] < 0.3, row  # one 4.5 MB model would be 15x this


def test_the_compressed_elastic_points_are_valid_train_commands_and_decay_their_step() -> None:
    """hsgd-topk's two group roots and W_g share each step three ways and a constant step
    keeps W_g swinging between the hosts' classes to the end (docs/choosing_a_method.md):
    the working point of hsgd-topk and seasgd-topk, the third, runs alpha 0.5 at lr 0.2
    decayed by --lr-schedule cosine."""
    from shmtrain.cli import build_parser
    from shmtrain.runtime.config import resolve
    from shmtrain.runtime.defaults import settle

    preset = hosts.SETTINGS["mlp-100mbit"]
    chosen = {}
    for method in ("seasgd-topk", "hsgd-topk"):
        for k, point in enumerate(hosts.method_points(preset["grid"], method), 1):
            settings = {**hosts.DEFAULTS, **{key: v for key, v in preset.items() if key in hosts.DEFAULTS}, **point}
            args = vars(build_parser().parse_args(hosts._worker_command(method, settings, Path("/tmp/x"))))
            config = resolve({key: v for key, v in args.items() if v is not None and key not in ("handler", "command")})
            config = settle(config, 2)  # across the bench's two hosts: the setting's defaults beside the point's
            options = config.strategy_config
            assert options.compress == "topk:0.1,bits:4" and options.host_lead == 0.05, (method, k)
            chosen[method, k] = (config.lr, config.lr_schedule, options.moving_rate)
    for method in ("seasgd-topk", "hsgd-topk"):
        assert chosen[method, 3] == (0.2, "cosine", 0.5)
        assert chosen[method, 2] == (0.2, "constant", 0.5) and chosen[method, 1] == (0.1, "constant", 0.5)


def test_untuned_without_lr_each_shmtrain_method_runs_at_its_own_defaults() -> None:
    """``--setting S --no-tune`` without ``--lr``: shmtrain's methods get no --lr (their
    defaults, which the hosts' setting picks: runtime/defaults.py), DDP the setting's lr;
    with --lr, tuning, or a grid point every method gets the lr."""
    from shmtrain.cli import build_parser
    from shmtrain.runtime.config import resolve
    from shmtrain.runtime.defaults import settle

    def jobs(*words: str) -> list:
        return hosts._jobs(build_parser().parse_args(["bench", "hosts", "--setting", "mlp-100mbit", *words]))

    (_, settings, _, _, tune), = jobs("--no-tune")
    assert settings["own_lr"] and not tune
    assert "--lr" not in hosts._worker_command("hsgd", settings, Path("/tmp/x"))
    ddp = hosts._worker_command("ddp", settings, Path("/tmp/x"))
    assert ddp[ddp.index("--lr") + 1] == "0.05"
    args = vars(build_parser().parse_args(hosts._worker_command("hsgd", settings, Path("/tmp/x"))))
    config = settle(resolve({k: v for k, v in args.items() if v is not None and k not in ("handler", "command")}), 2)
    assert (config.lr, config.lr_schedule, config.strategy_config.compress) == (0.2, "cosine", "topk:0.1,bits:4")
    for words in (["--no-tune", "--lr", "0.1"], ["--no-tune", "--grid-point", "1"], []):
        (_, settings, _, _, _), = jobs(*words)
        assert not settings["own_lr"] and "--lr" in hosts._worker_command("hsgd", settings, Path("/tmp/x")), words
