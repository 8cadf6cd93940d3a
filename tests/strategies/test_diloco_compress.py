"""DiLoCo with ``--compress`` (the compressed exchange of fabric/compress/allreduce.py)
and its outer step's defaults, derived from the inner optimizer: on the in-process peers
of tests/support/fake_hosts.py (whose fake transports build the real CompressedAllreduce
from in-process pieces and count each leader's payload), and a resume through real
processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conftest import new_segments
from shmtrain.fabric.compress.codec import Codec, parse_compress
from shmtrain.strategies.base import build_config
from shmtrain.strategies.diloco import OUTER_DILOCO, OUTER_UNDER_MOMENTUM, outer_defaults
from support.fake_hosts import peer_model, run_peers
from support.reference import flat_params, relative_error

IDENTITY = "topk:1,bits:32"  # every element kept, float32 values: D(C(x)) = x


@pytest.mark.timeout(60)
@pytest.mark.parametrize("options", [{"sync_every": 3}, {"sync_every": 4, "fragments": 2, "overlap_steps": 1},
                                     {"sync_every": 2, "inner": "host-sync"}])
def test_compression_off_is_bit_identical_to_the_exact_exchange(options: dict[str, Any]) -> None:
    """Without --compress the exchange is the exact allreduce as before (no compression
    state in the checkpoint); through the compressed path with a codec that keeps
    everything in float32 the weights are the same, bit for bit (one host: the host's
    mean is the job's)."""
    exact = run_peers("diloco", options, 2, 7)
    assert "compress" not in exact["engines"][0].state_dict()
    assert not hasattr(exact["engines"][0].exchanges, "compressor")
    identity = run_peers("diloco", {**options, "compress": IDENTITY}, 2, 7)
    assert exact["engines"][0].compress is None and identity["engines"][0].compress is not None
    for a, b in zip(exact["finals"], identity["finals"], strict=True):
        assert torch.equal(a, b)
    assert relative_error(exact["finals"][0], flat_params(peer_model())) > 1e-2  # the weights moved


@pytest.mark.timeout(60)
def test_the_staged_path_compresses_as_the_zero_copy_one(monkeypatch) -> None:
    """``SHMTRAIN_STAGING=copy`` (the GPU data flow): Δ_i copied into the host's slot, the
    decompressed mean copied back; the same weights."""
    options = {"sync_every": 2, "fragments": 2, "compress": "topk:0.1,bits:4"}
    plain = run_peers("diloco", options, 4, 5, hosts=2)
    monkeypatch.setenv("SHMTRAIN_STAGING", "copy")
    staged = run_peers("diloco", options, 4, 5, hosts=2)
    assert staged["engines"][0].staged and not plain["engines"][0].staged
    for a, b in zip(plain["finals"], staged["finals"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.timeout(60)
def test_compressed_bytes_across_hosts_are_the_payload_once_per_outer_step() -> None:
    """2 hosts x 2, H = 4, 12 iterations: each host's leader sends one payload per outer
    step (its host's mean, compressed), nothing else; the members send nothing."""
    steps, H = 12, 4
    numel = flat_params(peer_model()).numel()
    for text in ("topk:0.1,bits:4", "topk:0.25,bits:8", "topk:0.5,bits:32"):
        run = run_peers("diloco", {"sync_every": H, "compress": text}, 4, steps, hosts=2)
        payload = Codec(numel, parse_compress(text)).nbytes
        assert run["bytes_across"] == [payload * steps // H, 0, payload * steps // H, 0]
        assert payload < 4 * numel  # against the exact exchange's 4·P per outer step
        finals = run["finals"]
        assert all(torch.equal(finals[0], f) for f in finals)  # one θ^(t) everywhere after the last step
    tiny = Codec(numel, parse_compress("topk:0.1,bits:4")).nbytes
    assert tiny <= 4 * numel / 10


@pytest.mark.timeout(60)
def test_error_feedback_is_the_leaders_and_changes_the_run() -> None:
    run = run_peers("diloco", {"sync_every": 2, "compress": "topk:0.1,bits:4"}, 4, 6, hosts=2, finish=False)
    errors = [e.state_dict()["compress"][0]["error"] for e in run["engines"]]
    assert errors[0].abs().sum() > 0 and errors[2].abs().sum() > 0  # what the leaders left out
    assert errors[1] is None and errors[3] is None  # the members compress nothing, and keep no error
    off = run_peers("diloco", {"sync_every": 2, "compress": "topk:0.1,bits:4,feedback:off"}, 4, 6, hosts=2,
                    finish=False)
    assert off["engines"][0].state_dict()["compress"][0]["error"].abs().sum() == 0
    assert not torch.equal(run["finals"][0], off["finals"][0])


@pytest.mark.timeout(180)
def test_resume_with_compression_is_exact() -> None:
    """Real processes (the shared-memory CompressedAllreduce on one host): saved after 6
    iterations with an exchange in flight, resumed: the straight run's weights; the
    state holds each fragment's error feedback."""
    from support.resume import assert_exact_resume

    options = {"sync_every": 4, "fragments": 2, "overlap_steps": 1, "compress": "topk:0.1,bits:4"}
    states = assert_exact_resume({"strategy": "diloco", "options": options})
    saved = states[0]["strategy"]["compress"]
    assert len(saved) == 2 and all(s["spec"] == "topk:0.1,bits:4" for s in saved)
    assert all(s["error"].abs().sum() > 0 for s in saved)  # rank 0 leads the host


def test_a_checkpoint_with_other_compression_is_refused() -> None:
    plain = run_peers("diloco", {"sync_every": 2}, 1, 2, finish=False)["engines"][0]
    compressed = run_peers("diloco", {"sync_every": 2, "compress": "topk:0.1,bits:4"}, 1, 2, finish=False)["engines"][0]
    with pytest.raises(ValueError, match=r"written without --compress, this run has --compress topk:0.1,bits:4"):
        compressed.load_state_dict(plain.state_dict())
    with pytest.raises(ValueError, match=r"written with --compress, this run has none"):
        plain.load_state_dict(compressed.state_dict())
    other = run_peers("diloco", {"sync_every": 2, "compress": "topk:0.2,bits:4"}, 1, 1, finish=False)["engines"][0]
    with pytest.raises(ValueError, match=r"resume with the --compress and the model the checkpoint"):
        other.load_state_dict(compressed.state_dict())


@pytest.mark.parametrize(("options", "message"), [
    ({"compress": "topk:2"}, r"--compress 'topk:2': topk:2 must lie in \(0, 1\]"),
    ({"compress": "topk:0.1,bits:4", "outer_dtype": "bf16"},
     r"--outer-dtype bf16 with --compress topk:0.1,bits:4: both set how the pseudo-gradient travels"),
])
def test_bad_compression_options_are_refused(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_config("diloco", options)


def test_the_flag_and_toml_key() -> None:
    from shmtrain.cli import build_parser
    from shmtrain.runtime.config import resolve

    args = build_parser().parse_args(["train", "--strategy", "diloco", "--compress", "topk:0.01,bits:2"])
    values = {k: v for k, v in vars(args).items() if v is not None and k not in ("handler", "command")}
    assert resolve(values).strategy_config == build_config("diloco", {"compress": "topk:0.01,bits:2"})


# -- the outer step's defaults -----------------------------------------------------------------
@pytest.mark.parametrize(("make", "expected"), [
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), OUTER_UNDER_MOMENTUM),
    (lambda p: torch.optim.SGD(p, lr=0.1), OUTER_DILOCO),
    (lambda p: torch.optim.AdamW(p, lr=1e-3), OUTER_DILOCO),
])
def test_the_outer_defaults_follow_the_inner_optimizer(make, expected) -> None:
    """docs/diloco.md's table: under SGD with momentum, outer lr 1.0 and Nesterov 0.5
    (DiLoCo's 0.7 / 0.9 on top of it diverged); otherwise DiLoCo's."""
    assert outer_defaults(make(peer_model().parameters())) == expected
    assert OUTER_UNDER_MOMENTUM == (1.0, 0.5) and OUTER_DILOCO == (0.7, 0.9)


@pytest.mark.parametrize(("values", "lr", "momentum"), [
    ({}, "# outer-lr: 1.0, derived from the inner optimizer (SGD with momentum 0.9;",
     "# outer-momentum: 0.5, derived"),
    ({"momentum": 0.0}, "# outer-lr: 0.7, derived from the inner optimizer (SGD;", "# outer-momentum: 0.9, derived"),
    ({"optimizer": "adamw", "outer_momentum": 0.8}, "# outer-lr: 0.7, derived from the inner optimizer (AdamW;",
     "outer-momentum = 0.8"),
])
def test_config_toml_says_which_outer_step_the_run_took(values: dict, lr: str, momentum: str) -> None:
    """A diloco run's config.toml names its outer lr and momentum, given or derived."""
    from shmtrain.runtime.config import resolve, to_toml

    text = to_toml(resolve({"strategy": "diloco", **values}))
    assert lr in text and momentum in text, text


def test_the_engine_uses_the_derived_defaults_unless_given() -> None:
    derived = run_peers("diloco", {"sync_every": 2}, 1, 1)["engines"][0]  # fake_hosts.inner_sgd: SGD, momentum 0.9
    group = derived.outer_optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (1.0, 0.5, True)
    given = run_peers("diloco", {"sync_every": 2, "outer_lr": 0.3, "outer_momentum": 0.0}, 1, 1)["engines"][0]
    group = given.outer_optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.3, 0.0, False)


# -- two hosts (two torchrun launches on this machine) -------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_hosts_through_the_leaders_all_gather(tmp_path) -> None:
    """Real processes, 2 hosts x 2: with a codec that keeps everything the compressed
    exchange (host means in shared memory, the leaders' payloads all-gathered over gloo)
    equals the exact exchange of one host of 4; the hybrid with top-k 10% in 4 bits runs
    to the end on both hosts."""
    import json
    import subprocess
    import sys

    from support.torchrun import env, same_weights, two_hosts

    common = ["--strategy", "diloco", "--iterations", "12", "--seed", "3", "--no-progress", "--batch-size", "8",
              "--sync-every", "4"]
    two_hosts(tmp_path / "identity-2x2", [*common, "--compress", IDENTITY])
    subprocess.run([sys.executable, "-m", "shmtrain", "train", *common, "--workers", "4", "--out",
                    str(tmp_path / "exact-1x4")], check=True, timeout=150, env=env(), capture_output=True)
    same_weights(tmp_path / "exact-1x4", tmp_path / "identity-2x2")
    two_hosts(tmp_path / "hybrid-2x2", [*common, "--inner", "host-sync", "--compress", "topk:0.1,bits:4"])
    summary = json.loads((tmp_path / "hybrid-2x2" / "summary.json").read_text())
    assert summary["workers"] == 4 and summary["iterations"] == 12
    assert not new_segments(), new_segments()
