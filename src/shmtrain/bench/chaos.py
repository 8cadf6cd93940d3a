"""``shmtrain bench chaos``: what a run keeps of its throughput when a worker is killed
every few seconds.

For each run (a strategy and its flags), in one invocation: ``shmtrain train`` once
untouched and once while a random worker gets ``kill -9`` every ``--every`` seconds
(jittered by up to a quarter of it), with ``--max-restarts`` high enough for every
kill. Both train the same ``--iterations``; throughput is every rank's iterations over the
time from the first training row of any rank to the last (``t0`` in the metrics:
start-up is outside it, the recoveries inside). Throughput kept = killed / untouched.

Each pair is checked before it is reported: both exit 0, every rank's metrics hold the
iterations 1..N once each (nothing lost, nothing done twice), the launcher said how
each kill was recovered (replaced in place, or every worker restarted), and for the
synchronous strategies that recover in place the killed run's weights equal the
untouched run's bit for bit (``exact``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from shmtrain.bench.common import table, write_json

DEFAULT_RUNS = ["ssgd", "ssgd --overlap", "gpi", "seasgd", "hsgd --groups 2 --workers 4"]
#: the job every run trains (the flags before a run's own)
JOB = ["--model", "mlp", "--data", "synthetic", "--samples", "2048", "--input-shape", "1x8x8",
       "--batch-size", "16", "--checkpoint-every", "200", "--timeout", "60", "--no-progress"]


def workers_of(launcher: int) -> dict[int, int]:
    """rank -> pid of the workers of process ``launcher`` (forked by its zygote, each
    named ``shmtrain-w<rank>``), read from /proc."""
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    dead: set[int] = set()  # zombies: killed already, not yet reaped (a kill would change nothing)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                head, _, tail = f.read().rpartition(b")")
        except OSError:
            continue
        pid = int(entry)
        names[pid] = head.split(b"(", 1)[1].decode(errors="replace")
        fields = tail.split()
        parents[pid] = int(fields[1])
        if fields[0] in (b"Z", b"X"):
            dead.add(pid)
    found = {}
    for pid, name in names.items():  # a worker's parent is the zygote (the launcher's child), not a
        parent = parents.get(pid, 0)  # worker: its loader processes carry its name too
        if (name.startswith("shmtrain-w") and name[10:].isdigit() and parents.get(parent) == launcher
                and not names.get(parent, "").startswith("shmtrain-w") and pid not in dead):
            found[int(name[10:])] = pid
    return found


def _killer(launcher: subprocess.Popen, every: float, seed: int, kills: list[dict[str, Any]],
            done: threading.Event) -> None:
    rng = random.Random(seed)
    while not done.wait(every * rng.uniform(0.75, 1.25)):
        if launcher.poll() is not None:
            return
        workers = workers_of(launcher.pid)
        if not workers:  # still starting, or between a restart's launches
            continue
        rank = rng.choice(sorted(workers))
        try:
            os.kill(workers[rank], signal.SIGKILL)
        except ProcessLookupError:
            continue
        kills.append({"rank": rank, "pid": workers[rank], "at": time.time()})


def _rows(run: Path, workers: int) -> dict[int, list[dict[str, Any]]]:
    """Every rank's training rows (not its evaluation rows), in file order."""
    out = {}
    for rank in range(workers):
        lines = (run / "metrics" / f"rank-{rank}.jsonl").read_text().splitlines()
        out[rank] = [row for row in map(json.loads, lines) if "eval" not in row]
    return out


def _rate(rows: dict[int, list[dict[str, Any]]]) -> tuple[int, float]:
    """The iterations every rank logged and the seconds from the first row to the last
    (``t0``: start-up is outside it, the recoveries inside)."""
    starts = [r[0]["t0"] for r in rows.values() if r]
    ends = [r[-1]["t0"] for r in rows.values() if r]
    return sum(len(r) for r in rows.values()), max(ends) - min(starts)


def _pauses(rows: list[dict[str, Any]], count: int) -> float | None:
    """The median of the ``count`` longest pauses between rank 0's rows, less its median
    iteration: what one recovery cost it (None without recoveries)."""
    gaps = sorted(b["t0"] - a["t0"] for a, b in zip(rows, rows[1:], strict=False))
    if not count or len(gaps) <= count:
        return None
    return statistics.median(gaps[-count:]) - statistics.median(gaps)


def _check_rows(run: str, name: str, rows: dict[int, list[dict[str, Any]]], iterations: int,
                synchronous: bool, err: str) -> None:
    """Every rank logged iterations 1..k once each, in order (k = ``iterations`` for a
    synchronous run; an asynchronous one ends its ranks apart: TERM)."""
    for rank, logged in rows.items():
        seen = [r["iteration"] for r in logged]
        if seen != list(range(1, len(seen) + 1)) or (synchronous and len(seen) != iterations) or not seen:
            missing = sorted(set(range(1, max(seen, default=0) + 1)) - set(seen))
            twice = sorted({i for i in seen if seen.count(i) > 1})
            raise RuntimeError(f"{run}: rank {rank} of the {name} run logged {len(seen)} rows: iterations "
                               f"{missing[:10]} missing, {twice[:10]} twice; {err[-800:]}")


def _train(args: list[str], out: Path, every: float, seed: int) -> dict[str, Any]:
    """One ``shmtrain train`` (killed every ``every`` s when positive); what it did."""
    launcher = subprocess.Popen([sys.executable, "-m", "shmtrain", "train", *args, "--out", str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, SHMTRAIN_NO_PROGRESS="1"))
    kills: list[dict[str, Any]] = []
    done = threading.Event()
    killer = threading.Thread(target=_killer, args=(launcher, every, seed, kills, done), daemon=True)
    if every > 0:
        killer.start()
    try:
        _, err = launcher.communicate()
    finally:
        done.set()
    if launcher.returncode != 0:
        raise RuntimeError(f"shmtrain train {shlex.join(args)} exited {launcher.returncode}: {err.strip()[-600:]}")
    return {"kills": len(kills), "err": err,
            "replaced": err.count("replaced in place"), "restarted": err.count("restarting every worker")}


def _exact(a: Path, b: Path) -> bool:
    one, two = (torch.load(folder / "model.pt", weights_only=True) for folder in (a, b))
    return one.keys() == two.keys() and all(one[k].equal(two[k]) for k in one)


def run_pair(run: str, payload: dict[str, Any], base: Path) -> dict[str, Any]:
    """The untouched and the killed run of ``run`` in folders under ``base``; the checked row."""
    strategy, *flags = shlex.split(run)
    iterations, workers = payload["iterations"], payload["workers"]
    if "--workers" in flags:  # a run's own count (hsgd's groups) comes after the bench's, and wins
        workers = int(flags[flags.index("--workers") + 1])
    args = [*JOB, "--strategy", strategy, "--workers", str(payload["workers"]), "--iterations", str(iterations),
            "--max-restarts", str(payload["max_restarts"]), *flags]
    straight = _train(args, base / "straight", 0.0, payload["seed"])
    killed = _train(args, base / "killed", payload["every"], payload["seed"])
    from shmtrain import strategies

    synchronous = strategies.get(strategy).synchronous
    rates = {}
    for name, folder, result in (("untouched", "straight", straight), ("killed", "killed", killed)):
        rows = _rows(base / folder, workers)
        _check_rows(run, name, rows, iterations, synchronous, result["err"])
        rates[name] = _rate(rows)
        result["lost"] = sum("lost" in r for logged in rows.values() for r in logged)
        result["pause"] = _pauses(rows[0], killed["replaced"] + killed["restarted"]) if name == "killed" else None
    if killed["replaced"] + killed["restarted"] < killed["kills"] - 1:  # the last kill may land as it ends
        raise RuntimeError(f"{run}: {killed['kills']} kills but the launcher recovered {killed['replaced']} in "
                           f"place and restarted {killed['restarted']} times: {killed['err'][-600:]}")
    (done_u, span_u), (done_k, span_k) = rates["untouched"], rates["killed"]
    # a synchronous run ends with the untouched weights whether replaced in place or restarted
    compare = synchronous and killed["replaced"] + killed["restarted"] > 0
    return {
        "run": run, "workers": workers, "iterations": iterations, "every_s": payload["every"],
        "kills": killed["kills"], "replaced": killed["replaced"], "restarted": killed["restarted"],
        "untouched_s": span_u, "killed_s": span_k, "untouched_iterations": done_u, "killed_iterations": done_k,
        # iterations per second, every rank's, killed over untouched
        "kept": (done_k / span_k) / (done_u / span_u),
        # rows whose loss died with a killed worker (it had sent its gradient, not logged it)
        "lost_rows": killed["lost"],
        # what one recovery cost rank 0: the median of its longest pauses, less an iteration
        "per_kill_s": killed["pause"],
        "exact": _exact(base / "straight", base / "killed") if compare else None,
    }


def _handler(args: argparse.Namespace) -> int:
    if args.workers < 2 or args.iterations < 1 or not args.every > 0:
        raise ValueError(f"--workers {args.workers} (at least 2: one is killed), --iterations {args.iterations} "
                         f"(at least 1), --every {args.every} (seconds, above 0); use e.g. --workers 3 "
                         "--iterations 20000 --every 6")
    payload = {"workers": args.workers, "iterations": args.iterations, "every": args.every,
               "seed": args.seed, "max_restarts": args.max_restarts}
    rows = []
    with tempfile.TemporaryDirectory(prefix="shmtrain-bench-chaos-") as folder:
        for run in args.run or DEFAULT_RUNS:
            print(f"... {run}: untouched, then a worker killed every {args.every:g} s", flush=True)
            rows.append(run_pair(run, payload, Path(folder) / str(len(rows))))
            print(f"    kept {rows[-1]['kept']:.1%} over {rows[-1]['kills']} kills", flush=True)
    shown = [dict(r, exact={True: "yes", False: "NO", None: "-"}[r["exact"]],
                  per_kill_s="-" if r["per_kill_s"] is None else f"{r['per_kill_s']:.2f}") for r in rows]
    print(table(shown, [("run", "run", "s"), ("kills", "kills", "d"), ("replaced", "replaced", "d"),
                       ("restarted", "restarted", "d"), ("untouched_s", "untouched s", ".1f"),
                       ("killed_s", "killed s", ".1f"), ("kept", "kept", ".1%"), ("per_kill_s", "s/kill", "s"),
                        ("lost_rows", "lost rows", "d"),
                        ("exact", "exact", "s")]))
    print(f"({args.workers} workers unless a run says, {args.iterations} iterations each, kill -9 of a random "
          f"worker every {args.every:g} s +-25%; throughput = every rank's iterations per second of training; "
          "exact = the killed run's weights equal the untouched run's bit for bit)")
    write_json(args.json, rows)
    return 0


def add_parser(bench: argparse._SubParsersAction) -> None:
    """Register ``shmtrain bench chaos``."""
    p = bench.add_parser("chaos", help="throughput kept while a random worker is killed every few seconds",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", default=None,
                   help=f"a strategy and its flags, quoted; repeat for more (default: {', '.join(DEFAULT_RUNS)})")
    p.add_argument("--workers", type=int, default=3, help="workers of every run (default 3)")
    p.add_argument("--iterations", type=int, default=20000, help="iterations of every run (default 20000)")
    p.add_argument("--every", type=float, default=6.0, help="seconds between kills, +-25%% (default 6)")
    p.add_argument("--max-restarts", type=int, default=1000,
                   help="the killed runs' --max-restarts (default 1000: one for every kill)")
    p.add_argument("--seed", type=int, default=0, help="seed of the victims and the intervals (default 0)")
    p.add_argument("--json", help="write the rows here")
    p.set_defaults(handler=_handler)
