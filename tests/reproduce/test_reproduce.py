"""``shmtrain reproduce``: every NAME runs with --quick, writes NAME.md/.json/.png that
parse, and the claims it checks (those with a rule) hold; the frame's own behaviour."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shmtrain.cli import main
from shmtrain.reproduce import core

NAMES = list(core.registry())

#: the papers' reproductions, each must be registered
REQUIRED = {
    "shmcaffe-table2", "shmcaffe-tables5-6", "shmcaffe-fig7", "caffegpi-scaling",
    "trl-table3", "trl-table4", "swcaffe-fig10-11", "shmlearn-table5-1", "shmlearn-neuron",
}


def test_every_required_reproduction_is_registered() -> None:
    assert REQUIRED <= set(NAMES), sorted(REQUIRED - set(NAMES))


#: the reproductions over ~15 s even --quick: by hand (pytest -m slow); the rest, and the frame
#: every reproduction writes through (its files, its claims), by default
HEAVY = {"caffegpi-scaling", "shmcaffe-table2", "trl-table3", "trl-table4", "swcaffe-fig10-11", "shmcaffe-tables5-6"}


@pytest.mark.timeout(170)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY else n for n in NAMES])
def test_quick_reproduction_writes_its_files_and_its_claims_hold(name: str, tmp_path: Path) -> None:
    doc = core.run_reproduction(name, tmp_path, quick=True, log=lambda *_: None)
    saved = json.loads((tmp_path / f"{name}.json").read_text())
    assert saved["name"] == name and saved["quick"] is True
    assert saved["verdict"] in core.VERDICTS
    assert saved["claims"] and saved["why_differ"]
    assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (tmp_path / f"{name}.md").read_text()
    assert "| what | paper | ours |" in text and saved["verdict"] in text
    checked = [c for c in doc["claims"] if c["rule"]]
    assert checked, "a reproduction checks at least one claim's direction"
    failed = [f"{c['what']}: ours {c['ours']} ({c['rule']})" for c in checked if not c["holds"]]
    assert not failed, failed
    assert saved["seconds"] < 120, "--quick must finish in under 2 minutes here"


def test_list_names_every_reproduction(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reproduce", "--list"]) == 0
    out = capsys.readouterr().out
    for name in NAMES:
        assert name in out


def test_unknown_name_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reproduce", "no-such-result"]) == 2
    err = capsys.readouterr().err
    assert "no-such-result" in err and "--list" in err and "Traceback" not in err


def test_the_frame_writes_all_three_files_with_the_numbers_first(tmp_path: Path) -> None:
    def run(ctx: core.Context) -> core.Report:
        def plot(path: Path) -> None:
            assert (ctx.out / "frame-test.json").exists()  # the numbers are written first
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            plt.figure()
            plt.plot([1, 2])
            plt.savefig(path, format="png")
            plt.close()

        claim = core.Claim("speed-up", "10.1x", "1.8x", "0.9 of ideal", True, "> 1")
        return core.Report([claim], "reproduced in ratio", "two cores", {"x": [1, 2]}, plot)

    core.reproduction("frame-test", "a paper", "a claim", ("SEASGD",))(run)
    try:
        doc = core.run_reproduction("frame-test", tmp_path, quick=True, log=lambda *_: None)
    finally:
        core.REPRODUCTIONS.remove("frame-test")
    assert doc["data"] == {"x": [1, 2]}
    assert "| speed-up | 10.1x | 1.8x | 0.9 of ideal | yes (> 1) |" in (tmp_path / "frame-test.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "README.md", "frame-test.json", "frame-test.md", "frame-test.png"]
    assert "| [frame-test](frame-test.md) | a paper | a claim |" in (tmp_path / "README.md").read_text()


def test_shmcaffe_table2_multi_host_verdict_is_drawn_against_the_papers_2_8x(monkeypatch) -> None:
    from shmtrain.bench.hosts import command as hosts
    from shmtrain.reproduce.shmcaffe import table2_hosts as t

    assert t.verdict(2.9) == "reproduced" and t.verdict(2.7) == "reproduced"  # within 5% of 2.8
    assert t.verdict(2.3) == "reproduced in ratio" and t.verdict(1.04) == "not reproduced"
    assert t.verdict(None) == "not reproducible here"
    rows = {"seasgd": {"train_s": 2.0}, "ps_grad": {"train_s": 5.0}, "ssgd": {"train_s": 4.0}}
    assert t.ratio_of(rows) == 2.5 and t.ratio_of({"seasgd": {"train_s": 2.0}}) is None
    line = t.claim({"rows": rows, "ratio": 2.5, "verdict": t.verdict(2.5)})
    assert line.holds and "2.50x of the paper's 2.8x: reproduced in ratio" in line.compare
    assert "seasgd 2.00 s, ps_grad 5.00 s, ssgd 4.00 s" == line.ours
    monkeypatch.setattr(hosts, "why_not", lambda rate: "network namespaces need root (run it as root, e.g. with sudo)")
    skipped = t.measure(quick=False)
    assert skipped == {"skipped": "network namespaces need root (run it as root, e.g. with sudo)",
                       "verdict": "not reproducible here"}
    assert not t.claim(skipped).holds and "not measured: network namespaces need root" in t.claim(skipped).ours
    monkeypatch.setattr(hosts, "why_not", lambda rate: None)
    monkeypatch.delenv(t.HOSTS_ENV, raising=False)
    assert "--quick leaves the multi-host setting out" in t.measure(quick=True)["skipped"]
