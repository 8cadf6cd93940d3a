"""The defaults a run's setting picks (``runtime/defaults.py``): across hosts, seasgd and
hsgd compress, pace the hosts, take alpha 0.5 and a larger step decayed by cosine, the
hybrid takes H 10; what the user gave is kept; the record is in ``config.toml`` (which
reads back to the same run) and in the first metrics row; DiLoCo's defaults with 2
workers on one host end within 1 point of ssgd on digits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shmtrain.runtime.config import read_toml, resolve, to_toml
from shmtrain.runtime.defaults import settle
from support.runs import train


def test_across_hosts_seasgd_and_hsgd_take_the_measured_defaults_and_keep_what_was_given() -> None:
    for strategy in ({"strategy": "seasgd"}, {"strategy": "hsgd", "groups": 2, "group_size": 2, "workers": 4}):
        config = settle(resolve(strategy), 2)
        options = config.strategy_config
        assert (options.compress, options.host_lead, options.moving_rate) == ("topk:0.1,bits:4", 0.05, 0.5)
        assert (config.lr, config.lr_schedule) == (0.2, "cosine")
        assert [t["option"] for t in config.defaults_taken] == ["compress", "host-lead", "moving-rate", "lr",
                                                                "lr-schedule"]
        assert all(t["why"].startswith(f"{strategy['strategy']} across 2 hosts") for t in config.defaults_taken)
    # what the user gave stays, and is not in the record
    config = settle(resolve({"strategy": "seasgd", "lr": 0.1, "moving_rate": 0.3}), 2)
    assert (config.lr, config.strategy_config.moving_rate, config.lr_schedule) == (0.1, 0.3, "cosine")
    assert {t["option"] for t in config.defaults_taken} == {"compress", "host-lead", "lr-schedule"}
    # one host: the defaults as they were (recorded), nothing compressed or paced
    config = settle(resolve({"strategy": "seasgd"}), 1)
    assert (config.lr, config.lr_schedule, config.strategy_config.moving_rate) == (0.05, "constant", 0.2)
    assert config.strategy_config.compress == "" and config.strategy_config.host_lead == 0.0
    assert "seasgd on one host" in config.defaults_taken[0]["why"]


def test_the_hybrid_across_hosts_takes_h_10_unless_compressed_and_ssgd_takes_nothing() -> None:
    assert settle(resolve({"strategy": "diloco", "inner": "host-sync"}), 2).strategy_config.sync_every == 10
    assert settle(resolve({"strategy": "diloco", "inner": "host-sync"}), 1).strategy_config.sync_every == 20
    for inner in ("host-sync", "local"):  # compressed across hosts: averaged every 4 steps
        options = settle(resolve({"strategy": "diloco", "inner": inner, "compress": "topk:0.01,bits:4"}),
                         2).strategy_config
        assert (options.sync_every, options.outer_lr, options.outer_momentum) == (4, 1.0, 0.0)
    one_host = settle(resolve({"strategy": "diloco", "compress": "topk:0.01,bits:4"}), 1).strategy_config
    assert (one_host.sync_every, one_host.outer_lr, one_host.outer_momentum) == (20, None, None)
    assert settle(resolve({"strategy": "diloco"}), 2).strategy_config.sync_every == 20
    assert settle(resolve({"strategy": "diloco", "inner": "host-sync", "sync_every": 4}), 2).defaults_taken == ()
    config = resolve({"strategy": "ssgd"})
    assert settle(config, 2) is config and config.defaults_taken == ()


def test_config_toml_says_which_defaults_were_taken_and_reads_back_to_the_same_run(tmp_path: Path) -> None:
    config = settle(resolve({"strategy": "seasgd"}), 2)
    text = to_toml(config)
    assert '#   lr = 0.2: seasgd across 2 hosts:' in text and '#   compress = "topk:0.1,bits:4":' in text
    (tmp_path / "config.toml").write_text(text)
    again = resolve(read_toml(str(tmp_path / "config.toml")))
    assert again == config  # the values are in the file: a resume computes the same run
    assert settle(again, 2).defaults_taken == ()  # every option given now: nothing more to choose


def test_the_first_metrics_row_says_which_defaults_were_taken(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert train("--strategy", "seasgd", "--workers", "2", "--model", "mlp", "--data", "synthetic", "--samples",
                 "128", "--input-shape", "1x8x8", "--batch-size", "8", "--iterations", "6", "--no-progress",
                 "--out", str(out)) == 0
    rows = [json.loads(line) for line in (out / "metrics" / "rank-0.jsonl").read_text().splitlines()]
    first = next(r for r in rows if "eval" not in r)
    assert first["iteration"] == 1 and [d["option"] for d in first["defaults"]] == ["moving-rate", "lr",
                                                                                     "lr-schedule"]
    assert all("defaults" not in r for r in rows if r is not first)
    assert "# defaults this run's setting chose" in (out / "config.toml").read_text()


@pytest.mark.slow
def test_diloco_with_2_workers_on_digits_ends_within_a_point_of_ssgd(tmp_path: Path) -> None:
    """Each with its defaults (H 20, the outer step derived from the inner SGD with momentum)."""
    accuracy = {}
    for strategy in ("ssgd", "diloco"):
        assert train("--strategy", strategy, "--workers", "2", "--no-progress", "--out", str(tmp_path / strategy)) == 0
        accuracy[strategy] = json.loads((tmp_path / strategy / "summary.json").read_text())["accuracy"]
    assert accuracy["diloco"] >= accuracy["ssgd"] - 0.01, accuracy
    assert accuracy["ssgd"] > 0.95, accuracy
