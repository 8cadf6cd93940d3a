"""``shmtrain bench hosts``: time to accuracy across two hosts joined by a shaped link (issue 12).

The comparison of ShmCaffe's Table II and Figs. 8-12 (accuracy against wall time, and
the time each method needs to reach a target accuracy), scaled down to one machine:
two "hosts" are two network namespaces (``st<pid>a``, ``st<pid>b``, addresses
10.77.x.1 and .2) joined by a veth pair whose both ends are shaped with
``tc qdisc add dev DEV root tbf rate 1gbit burst 256kb latency 50ms`` (``--rate``;
``none`` leaves the link as fast as the kernel copies). Each host runs
``python -m torch.distributed.run --nnodes 2 --node-rank N --nproc-per-node 2
--master-addr 10.77.x.1 ...`` inside its namespace (``ip netns exec``), with
``OMP_NUM_THREADS=1`` and no ``GLOO_SOCKET_IFNAME``, once per method, one method after
the other, with the same model, data, batch, learning rate, seed and evaluation:

- ``ssgd``: synchronous SGD with ``--allreduce shm``, the hierarchical allreduce
  (shared memory inside a host, gloo among the hosts' leaders);
- ``hsgd``: ``--groups 2 --group-size 2``, one group per host (allreduce in shared
  memory inside it, SEASGD between the two group roots);
- ``seasgd``: every worker exchanges with the global weights on the memory server that
  global rank 0 starts (no ``--smb-server``);
- ``ddp``: PyTorch DistributedDataParallel over gloo among all four workers, flat
  (:mod:`shmtrain.bench.hosts_ddp`).

Rank 0 evaluates the held-out split every ``--eval-every`` iterations (the
``{"eval": ...}`` rows of ``metrics/rank-0.jsonl``). The time to accuracy of a method
is the start (``t0``) of its first evaluation whose accuracy is at least ``--target``,
counted from the moment the bench started the method's two torchrun processes (start-up
and rendezvous included, as a user waits for them); ``after start`` is the same time
counted from rank 0's first iteration (``startup``: launch to that iteration), which
leaves out what start-up costs. ``comm`` is the mean, over every rank and iteration
(the first left out), of the communication the training thread waited for (for DDP,
the wait at the end of backward for the last bucket's allreduce). With ``--repeat N``
the methods run N interleaved rounds and the table gives the medians; the JSON keeps
every round's row and accuracy curve.

The accuracy is rank 0's model: for hsgd and seasgd, rank 0's local weights, which
follow the global ones elastically; its host holds the memory server, so it iterates
faster than the workers across the link (``iterations_per_rank`` in the JSON).

Needs root and ``ip netns`` (and ``tc`` for a shaped link); the namespaces are removed
at the end whatever happens, and no traffic leaves them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shmtrain.bench.common import table

#: method -> the ``shmtrain train`` flags that choose it (None: the DDP script)
METHODS: dict[str, list[str] | None] = {
    "ssgd": ["--strategy", "ssgd", "--allreduce", "shm"],
    "hsgd": ["--strategy", "hsgd", "--groups", "2", "--group-size", "2"],
    "seasgd": ["--strategy", "seasgd"],
    "ddp": None,
    # not in the default set: ssgd averaging its gradients in bfloat16 (half the bytes on the link)
    "ssgd-bf16": ["--strategy", "ssgd", "--allreduce", "shm", "--comm-dtype", "bf16"],
}
#: the methods of a run without --methods (the issue's comparison)
DEFAULT_METHODS = ["ssgd", "hsgd", "seasgd", "ddp"]
DEFAULTS = {"model": "wide_mlp", "data": "digits", "batch_size": 32, "lr": 0.05, "iterations": 400,
            "eval_every": 10, "target": 0.95, "seed": 0}
#: the quick variant (the tests run it): a few iterations, a target every method reaches
QUICK = {"iterations": 30, "eval_every": 5, "target": 0.3, "lr": 0.1}
NODES, PER_NODE = 2, 2


class HostsUnavailable(ValueError):
    """This machine cannot make the two namespaced hosts (the message says why)."""


def why_not(rate: str) -> str | None:
    """Why two namespaced hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (run it as root, e.g. with sudo)"
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip() or 'exit status ' + str(probe.returncode)}"
    if rate != "none" and shutil.which("tc") is None:
        return "the `tc` tool (iproute2) is not installed, which shapes the link (or pass --rate none)"
    return None


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise HostsUnavailable(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


def _kill_inside(ns: str) -> None:
    """End what still runs in namespace ``ns`` (only this bench's processes are there)."""
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


@contextmanager
def two_hosts(rate: str) -> Iterator[tuple[str, str, str]]:
    """Two namespaces and a veth pair between them, shaped to ``rate`` both ways unless
    ``none``: yields (namespace a, namespace b, address of a); both are deleted on exit."""
    tag = f"st{os.getpid() % 100000}"
    a, b, subnet = f"{tag}a", f"{tag}b", f"10.77.{os.getpid() % 250}"
    made: list[str] = []
    try:
        for ns in (a, b):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb")
        for ns, dev, last in ((a, f"{tag}va", 1), (b, f"{tag}vb", 2)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{subnet}.{last}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if rate != "none":
                _ip("netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                    "rate", rate, "burst", "256kb", "latency", "50ms")
        yield a, b, f"{subnet}.1"
    finally:
        for ns in made:
            _kill_inside(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # the veth pair goes with it


def host_env() -> dict[str, str]:
    """A namespaced host's environment: as a new user has it (no GLOO_SOCKET_IFNAME), one
    torch thread per worker, no progress line."""
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    return dict(env, OMP_NUM_THREADS="1", SHMTRAIN_NO_PROGRESS="1")


def _worker_command(method: str, settings: dict[str, Any], out: Path) -> list[str]:
    """What each torchrun process runs: ``-m shmtrain train ...`` or the DDP script."""
    common = ["--model", settings["model"], "--data", settings["data"], "--batch-size", str(settings["batch_size"]),
              "--lr", str(settings["lr"]), "--iterations", str(settings["iterations"]),
              "--seed", str(settings["seed"]), "--eval-every", str(settings["eval_every"]),
              "--timeout", "60", "--out", str(out)]
    flags = METHODS[method]
    if flags is None:
        return ["-m", "shmtrain.bench.hosts_ddp", *common]
    return ["-m", "shmtrain", "train", *flags, *common, "--no-progress", "--checkpoint-every", "0",
            "--device", "cpu"]  # the papers' CPU hosts (and the DDP baseline's)


def run_method(method: str, hosts: tuple[str, str, str], port: int, settings: dict[str, Any],
               out: Path, logs: Path, limit: float, name: str | None = None) -> dict[str, Any]:
    """One job of 2 x 2 workers on the two hosts; returns its row (times from the launch).
    ``name``: of its logs (``logs/NAME-node<N>.log``; default the method)."""
    a, b, master = hosts
    name = name or method
    logs.mkdir(parents=True, exist_ok=True)
    procs, files = [], []
    load = os.getloadavg()[0]  # the machine's load as the job starts (a shared machine's noise)
    start = time.time()
    try:
        for node, ns in enumerate((a, b)):
            cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES),
                   "--node-rank", str(node), "--nproc-per-node", str(PER_NODE), "--master-addr", master,
                   "--master-port", str(port), "--rdzv-conf", "timeout=60",
                   *_worker_command(method, settings, out)]
            sink = open(logs / f"{name}-node{node}.log", "w")  # noqa: SIM115 - closed below
            files.append(sink)
            procs.append(subprocess.Popen(cmd, env=host_env(), stdout=sink, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + limit
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        wall = time.time() - start
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for f in files:
            f.close()
    codes = [p.returncode for p in procs]
    if any(codes):
        tail = (logs / f"{name}-node0.log").read_text(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"bench hosts: {name} failed (exit status {codes}, limit {limit:.0f} s); "
                           f"see {logs}/{name}-node*.log; node 0's last lines:\n  " + "\n  ".join(tail))
    return dict(summarize(method, out, start, wall, settings["target"]), loadavg_1m=round(load, 2))


def summarize(method: str, out: Path, start: float, wall: float, target: float) -> dict[str, Any]:
    """A method's row from its run folder: accuracy against seconds since ``start``."""
    from shmtrain.runtime.report import phase_means, read_evals, read_metrics

    evals = read_evals(out).get(0, [])
    rows = read_metrics(out)
    curve = [(e["t0"] - start, e["accuracy"], e["iteration"]) for e in evals]
    hit = next((c for c in curve if c[1] >= target), None)
    first = min((r["t0"] for r in rows.get(0, [])), default=start)
    means = phase_means(rows)
    per_rank = {rank: max((r["iteration"] for r in rank_rows), default=0) for rank, rank_rows in rows.items()}
    return {
        "method": method,
        "time_to_target_s": round(hit[0], 3) if hit else None,
        "train_time_to_target_s": round(hit[0] - (first - start), 3) if hit else None,
        "iterations_to_target": hit[2] if hit else None,
        "final_accuracy": curve[-1][1] if curve else None,
        "iterations": per_rank.get(0, 0),
        "iterations_per_rank": [per_rank[r] for r in sorted(per_rank)],
        "comm_ms": round(means.get("comm", 0.0) * 1e3, 3),
        "compute_ms": round(means.get("compute", 0.0) * 1e3, 3),
        "iteration_ms": round(means.get("iteration", 0.0) * 1e3, 3),
        "startup_s": round(first - start, 3),  # launch to rank 0's first iteration
        "wall_s": round(wall, 3),
        "curve": [{"s": round(s, 3), "accuracy": acc, "iteration": it} for s, acc, it in curve],
    }


#: the per-run numbers a method's row gives as the median over its rounds
MEDIAN_KEYS = ("time_to_target_s", "train_time_to_target_s", "iterations_to_target", "final_accuracy",
               "iterations", "comm_ms", "compute_ms", "iteration_ms", "startup_s", "wall_s", "loadavg_1m")


def combine(method: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A method's row over its rounds: the median of each number (of the time to target
    only when every round reached it, else None), the spread, and every round's row."""
    row: dict[str, Any] = {"method": method, "rounds": len(runs),
                           "reached": sum(r["time_to_target_s"] is not None for r in runs)}
    for key in MEDIAN_KEYS:
        values = [r[key] for r in runs if r[key] is not None]
        row[key] = statistics.median(values) if len(values) == len(runs) else None
    times = [r["time_to_target_s"] for r in runs if r["time_to_target_s"] is not None]
    row["time_to_target_range_s"] = [min(times), max(times)] if times else None
    row["runs"] = runs
    return row


def plot(rows: list[dict[str, Any]], target: float, title: str, path: Path) -> None:
    """Held-out accuracy against wall time since launch, one colour per method (ShmCaffe
    Figs. 8-12); with several rounds, the first is drawn bold and the others faint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for n, row in enumerate(rows):
        reached = "not reached" if row["time_to_target_s"] is None else f"{row['time_to_target_s']:.1f} s"
        if row["rounds"] > 1:
            reached = f"median {reached}, {row['reached']}/{row['rounds']} rounds"
        for k, run in enumerate(row["runs"]):
            ax.plot([c["s"] for c in run["curve"]], [c["accuracy"] for c in run["curve"]], color=f"C{n}",
                    marker="." if k == 0 else None, ms=3, lw=1.2 if k == 0 else 0.7, alpha=1.0 if k == 0 else 0.35,
                    label=f"{row['method']} ({reached})" if k == 0 else None)
    ax.axhline(target, color="grey", ls="--", lw=0.8)
    ax.set(xlabel="wall time since launch (s)", ylabel="held-out accuracy (rank 0)", title=title, ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8, title=f"time to {target:.0%}", title_fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(methods: list[str], settings: dict[str, Any], rate: str, out: Path, limit: float, repeat: int = 1,
        log=print) -> dict[str, Any]:
    """Every method in turn on one pair of namespaced hosts, ``repeat`` rounds (the methods
    interleaved, so a change in the machine's load falls on all of them); the JSON document."""
    reason = why_not(rate)
    if reason:
        raise HostsUnavailable(f"bench hosts cannot make two hosts here: {reason}")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    with two_hosts(rate) as hosts:
        log(f"hosts: namespaces {hosts[0]}, {hosts[1]} (master {hosts[2]}), link "
            f"{'tbf ' + rate if rate != 'none' else 'unshaped'}; run folders under {out}")
        port = 29500
        for round_ in range(repeat):
            for method in methods:
                name = method if repeat == 1 else f"{method}-r{round_ + 1}"
                log(f"... {name}", flush=True)
                row = run_method(method, hosts, port, settings, out / name, out / "logs", limit, name)
                port += 1  # a fresh port per job: no wait for the last one's sockets
                log(f"    {name}: target at {row['time_to_target_s']} s, final accuracy "
                    f"{row['final_accuracy']:.4f}, {row['iterations']} iterations, comm {row['comm_ms']} ms/iter",
                    flush=True)
                runs[method].append(row)
        namespaces = list(hosts[:2])
    command = None
    if sys.argv[1:3] == ["bench", "hosts"]:
        command = " ".join(["shmtrain", "bench", "hosts", *sys.argv[3:]])
    return {"bench": "hosts", "date": time.strftime("%Y-%m-%d"), "command": command, "rate": rate,
            "nodes": NODES, "workers_per_node": PER_NODE, "repeat": repeat, "settings": settings,
            "namespaces": namespaces, "rows": [combine(m, runs[m]) for m in methods]}


_RATE = re.compile(r"^\d+(\.\d+)?([kmgt]?bit|[kmgt]?bps)$", re.IGNORECASE)


def _handler(args: argparse.Namespace) -> int:
    methods = args.methods or DEFAULT_METHODS
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"--methods {unknown}: unknown; choose from {', '.join(METHODS)}")
    if args.rate != "none" and not _RATE.match(args.rate):
        raise ValueError(f"--rate {args.rate!r}: a tc rate such as 1gbit or 100mbit, or none")
    settings = dict(DEFAULTS, **(QUICK if args.quick else {}))
    for key in ("model", "data", "batch_size", "lr", "iterations", "eval_every", "target", "seed"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    if settings["iterations"] < 1 or settings["eval_every"] < 1 or settings["batch_size"] < 1:
        raise ValueError("--iterations, --eval-every and --batch-size must be at least 1")
    if not 0 < settings["target"] <= 1:
        raise ValueError(f"--target {settings['target']}: an accuracy in (0, 1]")
    out = Path(args.out or f"runs/bench-hosts-{time.strftime('%Y%m%d-%H%M%S')}")
    if args.repeat < 1:
        raise ValueError(f"--repeat {args.repeat}: at least 1 round")
    taken = [p.name for p in out.glob("*") if p.name.split("-r")[0] in methods]
    if taken:
        raise ValueError(f"--out {out}: {', '.join(taken)} already there; give a new folder")
    limit = args.run_timeout or (180.0 if args.quick else 900.0)
    try:
        doc = run(methods, settings, args.rate, out.resolve(), limit, args.repeat)
    except RuntimeError as exc:  # a method's job failed: its logs are named, no traceback
        print(f"shmtrain: error: {exc}", file=sys.stderr)
        return 1
    rows = doc["rows"]
    print(f"\nTime to {settings['target']:.0%} held-out accuracy, {settings['model']} on {settings['data']}, "
          f"{NODES} hosts x {PER_NODE} workers, batch {settings['batch_size']}/worker, lr {settings['lr']}, "
          f"link {args.rate}" + (f"; medians of {args.repeat} rounds:" if args.repeat > 1 else ":"))
    print(table(rows, [("method", "method", "s"), ("time_to_target_s", "s to target", ".1f"),
                       ("train_time_to_target_s", "after start", ".1f"),
                       ("final_accuracy", "final acc", ".4f"), ("iterations", "iterations", ".0f"),
                       ("comm_ms", "comm ms/it", ".1f"), ("iteration_ms", "iter ms", ".1f"),
                       ("startup_s", "startup s", ".1f"), ("wall_s", "wall s", ".1f"),
                       *([("reached", "reached", "d")] if args.repeat > 1 else [])]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    if args.plot:
        plot(rows, settings["target"], f"{settings['model']} on {settings['data']}, 2 hosts x 2 workers, "
             f"link {args.rate}", Path(args.plot))
    return 0


def add_parser(bench: argparse._SubParsersAction) -> None:
    """Register ``shmtrain bench hosts``."""
    p = bench.add_parser("hosts", help="time to accuracy across 2 namespaced hosts on a shaped link (root)",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", metavar="METHOD", help=f"from {' '.join(METHODS)} (default: {' '.join(DEFAULT_METHODS)})")
    p.add_argument("--target", type=float, help=f"held-out accuracy to reach (default {DEFAULTS['target']}; "
                                                f"--quick {QUICK['target']})")
    p.add_argument("--iterations", type=int, help=f"per worker (default {DEFAULTS['iterations']}; "
                                                  f"--quick {QUICK['iterations']})")
    p.add_argument("--eval-every", type=int, help=f"iterations between evaluations (default "
                                                  f"{DEFAULTS['eval_every']}; --quick {QUICK['eval_every']})")
    p.add_argument("--model", help=f"(default {DEFAULTS['model']})")
    p.add_argument("--data", help=f"(default {DEFAULTS['data']})")
    p.add_argument("--batch-size", type=int, help=f"per worker (default {DEFAULTS['batch_size']})")
    p.add_argument("--lr", type=float, help=f"(default {DEFAULTS['lr']})")
    p.add_argument("--seed", type=int, help=f"(default {DEFAULTS['seed']})")
    p.add_argument("--rate", default="1gbit", help="tc tbf rate of the link, both ways (default 1gbit; none: unshaped)")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of every method, interleaved; the table gives medians (default 1)")
    p.add_argument("--quick", action="store_true", help="the small variant (the tests run it)")
    p.add_argument("--out", help="run folders, one per method, and logs/ (default runs/bench-hosts-<time>)")
    p.add_argument("--run-timeout", type=float, help="seconds one method may take (default 900; --quick 180)")
    p.add_argument("--json", help="write the table, the settings and the curves here")
    p.add_argument("--plot", help="write accuracy against wall time here (PNG)")
    p.set_defaults(handler=_handler)
