"""Run PyTorch's distributed suite (``upstream_spawn.py``) on gloo and on shm and compare.

Every test that passes on gloo must pass on shm (``gloo_pass_shm_fail`` empty). Each run
is a subprocess in its own session with a hard timeout: on expiry the whole session (the
runner and the ranks it spawned) is killed. The shm runs' per-rank counts (shm groups
created, tensors reduced through shared memory) are summed per test.

Usage::

    python tests/support/conformance/compare.py --world-sizes 2 3 4 \\
        --json docs/results/conformance_upstream.json [--tests NAME ...] [--match REGEX]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "upstream_spawn.py"
#: gloo passes, shm cannot in this torch, and why: each must fail with exactly this text
#: (any other failure of the test still counts against shm)
EXPLAINED = {
    "test_ddp_logging_data_cpu": (
        "'custom' != 'gloo'",
        "DDP's logging data names the group's c10d BackendType, which is CUSTOM for every "
        "out-of-tree backend in torch 2.14.1 (ProcessGroup::backendTypeToString; the enum has "
        "no other value for one), so it reads 'custom' where the test expects the label; the "
        "same test on a group named shm would compare 'custom' with 'shm'",
    ),
}


def run(impl: str, world_size: int, out_dir: Path, *, tests: list[str] | None = None,
        match: str | None = None, timeout: float = 3600.0, start: str = "spawn") -> dict:
    """One runner subprocess; its outcomes, the summed shm counts and its wall time."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{impl}-{world_size}.json"
    counts = out_dir / f"{impl}-{world_size}.counts"
    log = out_dir / f"{impl}-{world_size}.log"
    for path in (out, counts):
        path.unlink(missing_ok=True)
    cmd = [sys.executable, str(RUNNER), "--impl", impl, "--world-size", str(world_size), "--out", str(out),
           "--start", start]
    if tests:
        cmd += ["--tests", *tests]
    if match:
        cmd += ["--match", match]
    env = dict(os.environ, SHMTRAIN_CONFORMANCE_COUNTS=str(counts), OMP_NUM_THREADS="1",
               PYTORCH_PRINT_REPRO_ON_FAILURE="0")
    start = time.monotonic()
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the runner and every rank it spawned
            proc.wait()
            raise AssertionError(f"{impl} at world size {world_size}: not done within {timeout:.0f} s "
                                 f"(log: {log})") from None
    if not out.exists():
        raise AssertionError(f"{impl} at world size {world_size}: the runner wrote no results "
                             f"(exit {proc.returncode}; log {log}):\n{log.read_text()[-3000:]}")
    result = json.loads(out.read_text())
    result["seconds"] = round(time.monotonic() - start, 1)
    result["counts"] = _counts(counts)
    return result


def _counts(path: Path) -> dict[str, dict]:
    """Per test: ranks that reported, shm groups, shared-memory reductions and the calls per
    op through shared memory (``shm``) and handed to gloo (``gloo``), summed over ranks."""
    summed: dict[str, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            test, _rank, groups, reductions, *ops = line.split()
            entry = summed.setdefault(test, {"ranks": 0, "groups": 0, "reductions": 0, "shm": {}, "gloo": {}})
            entry["ranks"] += 1
            entry["groups"] += int(groups)
            entry["reductions"] += int(reductions)
            for field in ops:
                how, rest = field.split(":", 1)
                op, n = rest.rsplit("=", 1)
                entry[how][op] = entry[how].get(op, 0) + int(n)
    return summed


def calls_per_op(counts: dict[str, dict], how: str) -> dict[str, int]:
    """Calls per op over every test (``how``: ``"shm"`` or ``"gloo"``)."""
    total: dict[str, int] = {}
    for entry in counts.values():
        for op, n in entry.get(how, {}).items():
            total[op] = total.get(op, 0) + n
    return dict(sorted(total.items()))


def compare(gloo: dict, shm: dict) -> dict:
    """The conformance counts: passed on gloo, passed on shm, and the tests gloo passes
    that shm does not (must be none)."""
    g, s = gloo["outcomes"], shm["outcomes"]
    passed_gloo = sorted(t for t, o in g.items() if o["outcome"] == "pass")
    passed_shm = sorted(t for t, o in s.items() if o["outcome"] == "pass")
    counts = shm["counts"]
    differ = {t: s.get(t, {"outcome": "missing", "detail": ""}) for t in passed_gloo if t not in passed_shm}
    explained = {t: o for t, o in differ.items() if t in EXPLAINED and EXPLAINED[t][0] in o["detail"]}
    return {
        "world_size": shm["world_size"],
        "selected": len(s),
        "passed_gloo": len(passed_gloo),
        "passed_shm": len(passed_shm),
        "gloo_pass_shm_fail": {t: o for t, o in differ.items() if t not in explained},
        "gloo_pass_shm_fail_explained": {t: EXPLAINED[t][1] for t in explained},
        "shm_pass_gloo_not": sorted(set(passed_shm) - set(passed_gloo)),
        "skipped_both": sorted(t for t in s if s[t]["outcome"] == "skip" and g.get(t, {}).get("outcome") == "skip"),
        "shm_reductions": sum(c["reductions"] for c in counts.values()),
        "shm_calls_per_op": calls_per_op(counts, "shm"),
        "gloo_calls_per_op": calls_per_op(counts, "gloo"),
        "tests_with_shm_reductions": sum(1 for c in counts.values() if c["reductions"]),
        # a test that passed on shm must have run on shm groups (every rank reported one)
        "shm_passed_without_shm_group": sorted(t for t in passed_shm if not counts.get(t, {}).get("groups")),
        "seconds": {"gloo": gloo["seconds"], "shm": shm["seconds"]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--tests", nargs="*")
    parser.add_argument("--match")
    parser.add_argument("--work", default="conformance-runs", help="folder of the runs' logs and outcomes")
    parser.add_argument("--json", help="write the comparison here")
    parser.add_argument("--record", help="write the tests gloo passed, per world size, here "
                                         "(tests/support/conformance/gloo_passes.json: the default suite's reference)")
    parser.add_argument("--timeout", type=float, default=4 * 3600.0, help="seconds per run")
    parser.add_argument("--start", choices=["spawn", "fork"], default="spawn",
                        help="how ranks start (upstream_spawn.py)")
    args = parser.parse_args()
    report, record = [], {}
    for world_size in args.world_sizes:
        runs = {impl: run(impl, world_size, Path(args.work) / args.start, tests=args.tests, match=args.match,
                          timeout=args.timeout, start=args.start)
                for impl in ("gloo", "shm")}
        row = {"start": args.start, **compare(runs["gloo"], runs["shm"])}
        record[str(world_size)] = sorted(t for t, o in runs["gloo"]["outcomes"].items() if o["outcome"] == "pass")
        report.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "skipped_both"}), flush=True)
    if args.record:
        Path(args.record).write_text(json.dumps({"torch": runs["gloo"]["torch"], "start": args.start,
                                                 "gloo_passes": record}, indent=1) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": runs["shm"]["torch"], "runs": report}, indent=1) + "\n")
    sys.exit(1 if any(row["gloo_pass_shm_fail"] for row in report) else 0)


if __name__ == "__main__":
    main()
