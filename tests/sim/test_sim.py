"""The simulator against the closed forms of swCaffe eqs. (2)-(6), and its CLI."""

from __future__ import annotations

import json
import math
import time

import pytest

from shmtrain.sim import cli
from shmtrain.sim.model import CostModel, rhd_closed_form, topo_closed_form
from shmtrain.sim.simulate import parse_bytes, simulate, simulate_all

SHAPES = [(2, 1), (2, 2), (8, 2), (8, 4), (16, 4), (32, 1), (32, 32), (64, 8), (1024, 256)]
MODEL = CostModel(alpha=3e-6, beta_inside=2e-10, beta_across=9e-10, gamma=1.5e-10)


def nbytes_for(p: int) -> int:
    return p * 4 * 1000  # n/p a whole number of float32


@pytest.mark.parametrize("p,q", SHAPES)
def test_rhd_matches_eqs_2_to_4(p, q):
    n = nbytes_for(p)
    row = simulate("rhd", p, q, n, MODEL)
    log_p = int(math.log2(p))
    for phase in ("reduce-scatter", "allgather"):
        counts = row.phases.get(phase, {"steps": 0, "bytes_inside": 0, "bytes_across": 0})
        assert counts["steps"] == log_p
        assert counts["bytes_across"] == (p - q) * n // p  # the beta_2 term
        assert counts["bytes_inside"] == (q - 1) * n // p  # the beta_1 term
    assert row.steps == 2 * log_p
    assert row.bytes_across == 2 * (p - q) * n // p
    want = rhd_closed_form(p, q, n, MODEL)["allreduce_s"]
    assert row.predicted_s == pytest.approx(want, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("p,q", SHAPES)
def test_topo_matches_eqs_5_and_6(p, q):
    n = nbytes_for(p)
    row = simulate("topo", p, q, n, MODEL)
    log_p = int(math.log2(p))
    for phase in ("reduce-scatter", "allgather"):
        counts = row.phases.get(phase, {"steps": 0, "bytes_inside": 0, "bytes_across": 0})
        assert counts["steps"] == log_p
        assert counts["bytes_across"] == (p // q - 1) * n // p
        assert counts["bytes_inside"] == (p - p // q) * n // p
    want = topo_closed_form(p, q, n, MODEL)["allreduce_s"]
    assert row.predicted_s == pytest.approx(want, rel=1e-12, abs=1e-15)
    if q > 1 and p > q:
        assert row.predicted_s < simulate("rhd", p, q, n, MODEL).predicted_s


@pytest.mark.parametrize("p,q", [(2, 1), (5, 5), (8, 4), (12, 3), (64, 8)])
def test_ring_and_tree_counts(p, q):
    n = nbytes_for(p)
    ring = simulate("ring", p, q, n, MODEL)
    assert ring.steps == 2 * (p - 1)
    assert ring.phases["reduce-scatter"]["steps"] == p - 1
    # every node sends 2(p-1) chunks of n/p; with contiguous groups only the last
    # node of each group sends across (when there is more than one group)
    per_node = 2 * (p - 1) * n // p
    assert max(ring.bytes_inside, ring.bytes_across) == per_node
    # alpha-beta-gamma, lock step: each round costs alpha + beta_slowest * n/p
    beta = MODEL.beta_across if p > q else MODEL.beta_inside
    want = 2 * (p - 1) * (MODEL.alpha + beta * n / p) + (p - 1) * (n / p) * MODEL.gamma
    assert ring.predicted_s == pytest.approx(want, rel=1e-12)
    tree = simulate("tree", p, q, n, MODEL)
    assert tree.steps == 2 * math.ceil(math.log2(p))
    assert tree.bytes_reduced == math.ceil(math.log2(p)) * n  # the root adds log p buffers


def test_non_power_of_two_rhd_adds_two_steps():
    row = simulate("rhd", 12, 3, nbytes_for(12), MODEL)
    assert row.steps == 2 * 3 + 2
    assert set(row.phases) == {"fold", "reduce-scatter", "allgather", "unfold"}


def test_hierarchical_crosses_only_between_leaders():
    p, q, n = 64, 8, nbytes_for(64)
    row = simulate("hierarchical", p, q, n, MODEL)
    assert row.phases["intra-reduce"]["bytes_across"] == 0
    assert row.phases["intra-broadcast"]["bytes_across"] == 0
    groups = p // q
    assert row.phases["across-reduce-scatter"]["bytes_across"] == (groups - 1) * n // groups
    assert row.steps == 2 * 3 + 2 * 3


def test_parse_bytes():
    assert parse_bytes("97.7MB") == 97_700_000
    assert parse_bytes("232.6 MiB") == round(232.6 * 2**20)
    assert parse_bytes("4096") == 4096
    assert parse_bytes("64KiB") == 65536
    assert parse_bytes("1.5GiB") == 3 * 2**29
    for bad in ("", "MB", "1.2.3MB", "-5MB", "0", "12 parsecs", "64k"):
        with pytest.raises(ValueError, match="--bytes"):
            parse_bytes(bad)


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match=r"--group-size 3 does not divide --nodes 8.*try"):
        simulate("rhd", 8, 3, 1000)
    with pytest.raises(ValueError, match="--nodes 0"):
        simulate("rhd", 0, 1, 1000)
    with pytest.raises(ValueError, match="--group-size -4"):
        simulate("rhd", 8, -4, 1000)
    with pytest.raises(ValueError, match="--bytes -1"):
        simulate("rhd", 8, 2, -1)
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'fast'.*ring, rhd"):
        simulate_all(8, 2, 1000, algorithms=["rhd", "fast"])
    with pytest.raises(ValueError, match="--beta-across"):
        CostModel(beta_across=-1.0)


def run_cli(argv):
    import argparse

    parser = argparse.ArgumentParser(prog="shmtrain")
    cli.add_sim_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.handler(args)


def test_cli_paper_sizes_under_ten_seconds(tmp_path, capsys):
    out = tmp_path / "sim.json"
    start = time.perf_counter()
    code = run_cli(["sim", "allreduce", "--nodes", "1024", "--group-size", "256",
                    "--bytes", "97.7MB", "232.6MB", "--json", str(out)])
    elapsed = time.perf_counter() - start
    assert code == 0
    assert elapsed < 10.0  # the requirement; it takes ~1 s here
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * 5
    for row in rows:
        assert {"algorithm", "steps", "bytes_inside", "bytes_across", "predicted_s"} <= set(row)
    by = {(r["algorithm"], r["bytes"]): r for r in rows}
    n = 97_700_000
    # (p/q - 1) n/p per phase; n/p is not a whole number of elements here, so +-1 element
    assert abs(by[("topo", n)]["bytes_across"] - 2 * 3 * n / 1024) <= 2 * 3 * 4
    assert by[("topo", n)]["predicted_s"] < by[("rhd", n)]["predicted_s"]
    table = capsys.readouterr().out
    for name in ("ring", "rhd", "tree", "topo", "hierarchical"):
        assert name in table
    assert "predicted ms" in table


def test_cli_errors(capsys):
    assert run_cli(["sim", "allreduce", "--nodes", "1000", "--group-size", "256",
                    "--bytes", "1MB"]) == 2
    assert "does not divide" in capsys.readouterr().err
    for argv in (["--nodes", "0", "--group-size", "1", "--bytes", "1MB"],
                 ["--nodes", "8", "--group-size", "-2", "--bytes", "1MB"],
                 ["--nodes", "8", "--group-size", "2", "--bytes=-1MB"],
                 ["--nodes", "8", "--group-size", "2", "--bytes", "1MB", "--algorithms", "x"],
                 ["--nodes", "8", "--group-size", "2", "--bytes", "1MB", "--alpha", "-1"]):
        with pytest.raises(SystemExit) as info:
            run_cli(["sim", "allreduce", *argv])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "error: argument" in err
