"""DiLoCo (Douillard et al. 2023, Algorithm 1), its streaming fragments and bf16 outer
gradients (Streaming DiLoCo, 2025), and the hybrid ``--inner host-sync``: the equations
against single-process references, the bytes each method hands the link, exact resume,
and the refusals.

Most tests run the strategies on in-process peers (threads) through a fake
``Transports`` that also plays the hosts: ``allreduce`` averages over every peer and
counts the bytes a host's leader sends to the other hosts (the hierarchical allreduce's
only link traffic: the host's reduced buffer, ``fabric/allreduce/shared.py``), and
``group_allreduce`` averages inside a host (``tests/support/fake_hosts.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from conftest import new_segments
from shmtrain.strategies.base import build_config
from support.fake_hosts import inner_sgd, peer_batches, peer_model, run_peers
from support.reference import flat_params, relative_error


def reference(steps: int, groups: list[list[int]], sync_every: int, fragments: int, outer_lr: float,
              outer_momentum: float, overlap_steps: int = 0, mixing: float = 0.0) -> list[torch.Tensor]:
    """DiLoCo Algorithm 1 in one process, written from the equations: one model per
    group (a worker, or a host that averages its members' gradients every step), its
    own inner SGD; fragment f's Δ = mean_i(θ − θ_i) after n inner steps with
    n mod H = f·H/F, applied τ steps later: m ← μ m + Δ, θ ← θ − lr (Δ + μ m)
    (Nesterov), θ_i ← α θ_i + (1 − α) θ (Streaming DiLoCo's overlap and mixing).
    Returns each group's final weights."""
    peers = sum(len(g) for g in groups)
    xs, ys = peer_batches(steps, peers)
    models = [peer_model() for _ in groups]
    optimizers = [inner_sgd(m) for m in models]
    theta = flat_params(models[0])
    numel = theta.numel()
    cuts = [numel * f // fragments for f in range(fragments + 1)]
    momentum = torch.zeros(numel)
    pending: tuple[int, int, torch.Tensor] | None = None

    def apply(f: int, delta: torch.Tensor) -> None:
        lo, hi = cuts[f], cuts[f + 1]
        momentum[lo:hi] = outer_momentum * momentum[lo:hi] + delta
        theta[lo:hi] -= outer_lr * (delta + outer_momentum * momentum[lo:hi])
        for model in models:
            flat = flat_params(model)
            flat[lo:hi] = mixing * flat[lo:hi] + (1 - mixing) * theta[lo:hi]
            torch.nn.utils.vector_to_parameters(flat, model.parameters())

    for step in range(steps):
        for model, opt, members in zip(models, optimizers, groups, strict=True):
            opt.zero_grad()
            x, y = xs[step, members].flatten(0, 1), ys[step, members].flatten()
            nn.functional.cross_entropy(model(x), y).backward()  # the mean over the group's batches
            opt.step()
        done = step + 1
        if pending is not None and pending[1] == done:
            apply(pending[0], pending[2])
            pending = None
        for f in range(fragments):
            if done % sync_every != f * sync_every // fragments:
                continue
            lo, hi = cuts[f], cuts[f + 1]
            delta = torch.stack([theta[lo:hi] - flat_params(m)[lo:hi] for m in models]).mean(0)
            if overlap_steps:
                pending = (f, done + overlap_steps, delta)
            else:
                apply(f, delta)
    return [flat_params(m) for m in models]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("peers", [2, 4])
def test_one_inner_step_with_a_unit_outer_step_equals_ssgd(peers: int) -> None:
    """H = 1, outer lr 1, no momentum: θ^(t) = mean_i θ_i, which for SGD (linear in the
    gradient, momentum and weight decay included) is ssgd's step on the mean gradient."""
    steps = 6
    ssgd = run_peers("ssgd", {}, peers, steps)["finals"]
    diloco = run_peers("diloco", {"sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0}, peers, steps)["finals"]
    for rank in range(peers):
        assert relative_error(diloco[rank], ssgd[rank]) < 1e-5, rank
    assert relative_error(ssgd[0], flat_params(peer_model())) > 1e-2  # the weights moved


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("sync_every", "fragments"), [(4, 1), (4, 2), (3, 3)])
def test_outer_steps_equal_the_equations(sync_every: int, fragments: int) -> None:
    """H > 1 with Nesterov momentum: two outer steps (so the momentum counts), every
    fragment at its own offset, against :func:`reference`."""
    peers, steps = 3, 2 * sync_every
    options = {"sync_every": sync_every, "fragments": fragments, "outer_lr": 0.7, "outer_momentum": 0.9}
    run = run_peers("diloco", options, peers, steps)
    expected = reference(steps, [[r] for r in range(peers)], sync_every, fragments, 0.7, 0.9)
    for rank in range(peers):
        assert relative_error(run["finals"][rank], expected[rank]) < 1e-5, rank
    # the outer step differs from plain averaging (outer lr 1, no momentum) by far more
    averaged = reference(steps, [[r] for r in range(peers)], sync_every, fragments, 1.0, 0.0)
    assert relative_error(averaged[0], expected[0]) > 1e-3
    assert run["engines"][0].outer_steps == 2 * fragments


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("overlap_steps", "mixing"), [(1, 0.0), (2, 0.5)])
def test_overlapped_fragments_equal_the_equations(overlap_steps: int, mixing: float) -> None:
    """Streaming DiLoCo's overlap: each fragment's exchange runs on a helper thread during
    the next τ inner steps and is applied after them, mixed with α; H = 6, F = 2."""
    peers, steps, H, F = 3, 14, 6, 2
    options = {"sync_every": H, "fragments": F, "overlap_steps": overlap_steps, "mixing": mixing,
               "outer_lr": 0.7, "outer_momentum": 0.9}
    run = run_peers("diloco", options, peers, steps)
    expected = reference(steps, [[r] for r in range(peers)], H, F, 0.7, 0.9, overlap_steps, mixing)
    for rank in range(peers):
        assert relative_error(run["finals"][rank], expected[rank]) < 1e-5, rank
    unlapped = reference(steps, [[r] for r in range(peers)], H, F, 0.7, 0.9, 0, mixing)
    assert relative_error(unlapped[0], expected[0]) > 1e-4  # the delay is not a no-op
    engine = run["engines"][0]
    # exchanges started at 3, 6, 9, 12; the one of 12 is applied after 12 + τ <= 14
    assert engine.outer_steps == 4 and engine.pending is None


@pytest.mark.timeout(60)
def test_one_outer_step_after_h_steps_equals_the_equations() -> None:
    """The issue's check as stated: one outer step (H = 5, no streaming), and the weights
    between two outer steps are each worker's own (not yet synchronised)."""
    peers, H = 2, 5
    run = run_peers("diloco", {"sync_every": H, "outer_lr": 0.5, "outer_momentum": 0.9}, peers, H)
    expected = reference(H, [[0], [1]], H, 1, 0.5, 0.9)
    assert torch.equal(expected[0], expected[1])
    assert all(relative_error(f, expected[0]) < 1e-5 for f in run["finals"])
    before = run_peers("diloco", {"sync_every": H, "outer_lr": 0.5, "outer_momentum": 0.9}, peers, H - 1)
    assert relative_error(before["finals"][0], before["finals"][1]) > 1e-4


@pytest.mark.timeout(60)
def test_the_hybrid_is_ssgd_inside_a_host_and_diloco_between_hosts() -> None:
    """``--inner host-sync`` on 2 hosts x 2: the members of a host stay identical every
    step, and the hosts meet every H steps by the outer step (the reference with one
    model per host on the union of its members' batches)."""
    steps, H = 6, 3
    options = {"inner": "host-sync", "sync_every": H, "outer_lr": 0.7, "outer_momentum": 0.9}
    run = run_peers("diloco", options, 4, steps, hosts=2)
    assert run["class"].__name__ == "HostSyncDiLoCo"
    expected = reference(steps, [[0, 1], [2, 3]], H, 1, 0.7, 0.9)
    for rank in range(4):
        assert relative_error(run["finals"][rank], expected[rank // 2]) < 1e-5, rank
    mid = run_peers("diloco", options, 4, H + 1, hosts=2)["finals"]
    assert torch.equal(mid[0], mid[1]) and torch.equal(mid[2], mid[3])  # synchronous inside a host
    assert relative_error(mid[0], mid[2]) > 1e-4  # hosts apart between outer steps
    # on one host with a unit outer step it is ssgd whatever H
    one = run_peers("diloco", {"inner": "host-sync", "sync_every": 4, "outer_lr": 1.0, "outer_momentum": 0.0},
                    2, 6)["finals"]
    ssgd = run_peers("ssgd", {}, 2, 6)["finals"]
    assert relative_error(one[0], ssgd[0]) < 1e-5


@pytest.mark.timeout(120)
def test_bytes_across_hosts_per_iteration_are_1_over_h_of_ssgd_and_half_again_in_bf16() -> None:
    """Counted: what each host's leader sends to the other hosts, per iteration, on 2
    hosts x 2 workers over 12 iterations (H = 4)."""
    steps, H = 12, 4
    numel = flat_params(peer_model()).numel()

    def per_iteration(strategy: str, options: dict[str, Any]) -> float:
        sent = run_peers(strategy, options, 4, steps, hosts=2)["bytes_across"]
        assert sent[1] == sent[3] == 0  # only the leaders use the link
        assert sent[0] == sent[2]
        return sent[0] / steps

    ssgd = per_iteration("ssgd", {})
    diloco = per_iteration("diloco", {"sync_every": H})
    bf16 = per_iteration("diloco", {"sync_every": H, "outer_dtype": "bf16"})
    streaming = per_iteration("diloco", {"sync_every": H, "fragments": 2})
    hybrid = per_iteration("diloco", {"sync_every": H, "inner": "host-sync", "outer_dtype": "bf16"})
    assert ssgd == 4 * numel
    assert diloco <= ssgd / H and diloco == numel
    assert bf16 <= diloco / 2 and bf16 == numel / 2
    assert streaming == diloco  # the same bytes, spread over the period
    assert hybrid == bf16  # the per-step gradient average stays inside the hosts


@pytest.mark.timeout(60)
def test_bf16_outer_gradients_stay_close_to_fp32() -> None:
    """bfloat16 rounds the pseudo-gradient (8 bits of mantissa), not the outer state."""
    options = {"sync_every": 3, "outer_lr": 0.7, "outer_momentum": 0.9}
    fp32 = run_peers("diloco", options, 2, 6)["finals"][0]
    bf16 = run_peers("diloco", {**options, "outer_dtype": "bf16"}, 2, 6)["finals"]
    assert torch.equal(bf16[0], bf16[1])  # still the same θ everywhere
    assert 0 < relative_error(bf16[0], fp32) < 1e-2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("inner", ["local", "host-sync"])
def test_the_staged_path_equals_the_zero_copy_one(inner: str, monkeypatch) -> None:
    """``SHMTRAIN_STAGING=copy``: the GPU data flow on the CPU (Δ_i copied to the host
    slot, the mean copied back; the hybrid's gradients through ssgd's staged slots)."""
    options = {"sync_every": 2, "fragments": 2, "inner": inner}
    plain = run_peers("diloco", options, 2, 5, hosts=2 if inner == "host-sync" else 1)
    monkeypatch.setenv("SHMTRAIN_STAGING", "copy")
    staged = run_peers("diloco", options, 2, 5, hosts=2 if inner == "host-sync" else 1)
    assert staged["engines"][0].staged and not plain["engines"][0].staged
    assert "copy_to_host" in staged["engines"][0].timer.current
    for a, b in zip(plain["finals"], staged["finals"], strict=True):
        assert torch.equal(a, b)


# -- checkpoints -------------------------------------------------------------------------
@pytest.mark.timeout(180)
@pytest.mark.parametrize("options", [
    {"sync_every": 4, "fragments": 2, "outer_lr": 0.7, "outer_momentum": 0.9},
    {"sync_every": 4, "fragments": 2, "overlap_steps": 1, "mixing": 0.5},
    {"sync_every": 4, "inner": "host-sync", "outer_dtype": "bf16"},
])
def test_resume_mid_period_is_exact(options: dict[str, Any]) -> None:
    """Saved after 6 iterations (mid-period: fragment 1 synchronised at 6, fragment 0 due
    at 8) and resumed on a fresh fabric: the straight run's weights; the state holds
    θ^(t) and the outer momentum."""
    from support.resume import HALF, assert_exact_resume

    states = assert_exact_resume({"strategy": "diloco", "options": options})
    state = states[0]["strategy"]
    assert state["iteration"] == HALF
    assert len(state["global_weights"]) == options.get("fragments", 1)
    if options.get("overlap_steps"):  # fragment 1's exchange of iteration 6, to apply after 7
        assert state["pending"]["fragment"] == 1 and state["pending"]["apply_at"] == HALF + 1
    momenta = [s["momentum_buffer"] for s in state["outer_optimizer"]["state"].values()]
    assert momenta and all(m.abs().sum() > 0 for m in momenta)


def test_a_checkpoint_of_other_fragments_is_refused() -> None:
    run = run_peers("diloco", {"sync_every": 2, "fragments": 2}, 1, 2)
    engine = run["engines"][0]
    state = engine.state_dict()
    other = run_peers("diloco", {"sync_every": 2, "fragments": 1}, 1, 1)["engines"][0]
    with pytest.raises(ValueError, match=r"resume with the --fragments and the model the checkpoint"):
        other.load_state_dict(state)


# -- options -----------------------------------------------------------------------------
@pytest.mark.parametrize(("options", "message"), [
    ({"sync_every": 0}, r"--sync-every 0 must be an integer >= 1: the inner steps between outer steps; pass e\.g\."),
    ({"fragments": 0}, r"--fragments 0 must be an integer >= 1"),
    ({"sync_every": 4, "fragments": 3}, r"--fragments 3 must divide --sync-every 4: fragment f is synchronised "
                                        r"at offset f\*H/F; choose"),
    ({"outer_lr": 0.0}, r"--outer-lr 0.0 must be positive: .*pass e\.g\. --outer-lr 0.7"),
    ({"outer_momentum": 1.0}, r"--outer-momentum 1.0 must lie in \[0, 1\): .*--outer-momentum 0.9"),
    ({"outer_dtype": "fp16"}, r"--outer-dtype 'fp16' is unknown; choose fp32 or bf16"),
    ({"sync_every": 4, "fragments": 2, "overlap_steps": 2},
     r"--overlap-steps 2 must be an integer in \[0, --sync-every / --fragments = 2\): one fragment's exchange"),
    ({"mixing": 1.0}, r"--mixing 1.0 must lie in \[0, 1\): .*pass e\.g\. --mixing 0.5"),
    ({"inner": "group"}, r"--inner 'group' is unknown; choose local \(DiLoCo\) or host-sync \(the hybrid\)"),
    ({"moving_rate": 0.5}, r"--moving-rate does not apply to --strategy diloco \(it takes .*--sync-every"),
])
def test_bad_options_are_refused_naming_the_option_the_rule_and_the_fix(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_config("diloco", options)


def test_the_options_are_flags_and_toml_keys(tmp_path) -> None:
    from shmtrain.cli import build_parser
    from shmtrain.runtime.config import read_toml, resolve, to_toml

    args = build_parser().parse_args(["train", "--strategy", "diloco", "--sync-every", "8", "--outer-lr", "0.5",
                                      "--outer-momentum", "0.8", "--outer-dtype", "bf16", "--fragments", "4",
                                      "--inner", "host-sync"])
    values = {k: v for k, v in vars(args).items() if v is not None and k not in ("handler", "command")}
    config = resolve(values)
    assert config.strategy_config == build_config("diloco", {
        "sync_every": 8, "outer_lr": 0.5, "outer_momentum": 0.8, "outer_dtype": "bf16", "fragments": 4,
        "inner": "host-sync"})
    path = tmp_path / "c.toml"
    path.write_text(to_toml(config))
    assert resolve(read_toml(str(path))).strategy_config == config.strategy_config
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--outer-dtype", "fp16"])
    with pytest.raises(ValueError, match=r"--sync-every 2.5"):
        resolve({"strategy": "diloco", "sync_every": 2.5})


# -- two hosts (two torchrun launches on this machine) -----------------------------------
@pytest.mark.slow  # ~95 s of CPU; the two-host hierarchical path runs by default in backend/test_backend.py
@pytest.mark.timeout(420)
def test_two_hosts_through_the_hierarchical_allreduce(tmp_path) -> None:
    """Real processes: streaming diloco with overlap on 2 hosts x 2 (the pseudo-gradients
    summed in each host's shared memory, then between the leaders over gloo, on the
    helper thread) equals one host of 4; the hybrid
    on 2 hosts x 2 with batch 8 equals diloco of 2 lone workers with batch 16 (a host
    that averages its members' gradients every step is one worker on their union)."""
    import subprocess
    import sys

    from support.torchrun import env, same_weights, two_hosts

    common = ["--strategy", "diloco", "--iterations", "12", "--seed", "3", "--no-progress"]
    streaming = [*common, "--batch-size", "8", "--sync-every", "4", "--fragments", "2", "--overlap-steps", "1",
                 "--mixing", "0.5"]
    two_hosts(tmp_path / "2x2", streaming)
    subprocess.run([sys.executable, "-m", "shmtrain", "train", *streaming, "--workers", "4", "--out",
                    str(tmp_path / "1x4")], check=True, timeout=150, env=env(), capture_output=True)
    same_weights(tmp_path / "1x4", tmp_path / "2x2")
    hybrid = [*common, "--sync-every", "3"]
    two_hosts(tmp_path / "hybrid-2x2", [*hybrid, "--batch-size", "8", "--inner", "host-sync"])
    subprocess.run([sys.executable, "-m", "shmtrain", "train", *hybrid, "--batch-size", "16", "--workers", "2",
                    "--out", str(tmp_path / "lone-2")], check=True, timeout=150, env=env(), capture_output=True)
    same_weights(tmp_path / "lone-2", tmp_path / "hybrid-2x2")
    assert not new_segments(), new_segments()
