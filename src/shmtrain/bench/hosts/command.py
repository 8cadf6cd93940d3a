"""``shmtrain bench hosts``: time to accuracy across two hosts joined by a shaped link.

The comparison of ShmCaffe's Table II and Figs. 8-12 (accuracy against wall time, and
the time each method needs to reach a target accuracy), scaled down to one machine:
two "hosts" are two network namespaces joined by a veth pair shaped to ``--rate``
(:mod:`shmtrain.bench.hosts.net`). Each method is one job, 2 workers per host, launched
by torchrun inside each namespace with ``OMP_NUM_THREADS=1`` and no
``GLOO_SOCKET_IFNAME``, with the same model, data, batch, seed and evaluation:

- ``ssgd``: synchronous SGD with ``--allreduce shm``, the hierarchical allreduce
  (shared memory inside a host, gloo among the hosts' leaders);
- ``hsgd``: ``--groups 2 --group-size 2``, one group per host (allreduce in shared
  memory inside it, SEASGD between the two group roots);
- ``seasgd``: every worker exchanges with the global weights on the memory server that
  global rank 0 starts;
- ``diloco``: DiLoCo's outer Nesterov step every H local steps;
- ``hybrid``: ``diloco --inner host-sync``, synchronous inside a host, DiLoCo between the
  hosts;
- ``diloco-topk``, ``hybrid-topk``: the same with ``--compress topk:0.01,bits:4`` (each
  host's leader sends the top 1% of its host's pseudo-gradient in 4 bits, with error
  feedback; docs/diloco.md) instead of the bfloat16 exchange;
- ``seasgd-topk``, ``hsgd-topk``: ``--compress topk:0.1,bits:4`` (compressed differences
  across the link; docs/async.md), which seasgd and hsgd take across hosts by default too;
  grid: alpha 0.5 at lr 0.1, 0.2, and 0.2 with ``--lr-schedule cosine`` (docs/choosing_a_method.md);
- ``ddp``: PyTorch DistributedDataParallel over gloo among all four workers, flat
  (:mod:`shmtrain.bench.hosts.ddp`);
- ``one-host``: ssgd on host a alone (2 workers), the shard of one host: with
  ``--class-split 2`` it shows that a single host cannot reach the target.

Every shmtrain method runs with the flags that choose it (:data:`METHODS`) and the
setting's defaults for the rest (``runtime/defaults.py``: across hosts, e.g. H 10 for the
hybrid, the hosts paced and a decayed step for seasgd and hsgd); ``--no-tune`` without
``--lr`` leaves the learning rate to them too (DDP runs at the setting's ``--lr``).

Fair to every method:

- **the job's model is evaluated**: rank 0 evaluates the held-out split every
  ``--eval-every`` iterations, and for hsgd, seasgd, diloco and hybrid it evaluates the
  global weights (the memory server's W_g, DiLoCo's outer model θ^(t);
  ``Strategy.global_weights_now``), not rank 0's own copy (``evaluated`` in the rows);
- **a tuned learning rate for each**: with ``--tune`` every method runs once per point
  of the setting's grid (the same points, so the same budget, for every method; the
  grid is :data:`SETTINGS`' ``grid``), and the rounds use the point that reached the
  target soonest (else the highest accuracy);
- **interleaved rounds**: ``--repeat N`` runs N rounds, the method order rotated by one
  place per round; the table gives the medians;
- **counted bytes**: the veth's byte counters around every job (``link MB``; ``link
  kB/it`` per worker iteration);
- **per-host numbers**: iterations per worker on each host (asynchronous workers far
  from the memory server do fewer) and the start-up of each host (launch to its first
  iteration; ``startup`` is the later of the two).

The time to accuracy of a method is the start of its first evaluation whose accuracy
is at least ``--target``, counted from the launch of its torchrun processes (start-up
and rendezvous included); ``after start`` counts from rank 0's first iteration.
``comm`` is the mean, over every rank and iteration (the first left out), of the
communication the training thread waited for (for DDP, the wait at the end of backward
for the last bucket's allreduce); ``comm %`` its share of the iteration.

``--setting NAME`` chooses one of the two written-down comparisons (:data:`SETTINGS`;
several names run one after the other, each with its own JSON and plot):
``mlp-100mbit`` (wide_mlp, 4.5 MB of gradients, link 100 Mbit/s) and
``resnet18-1gbit`` (ResNet-18 on digits upscaled to 3x32x32, 44.7 MB, 1 Gbit/s), both
with ``--class-split 2`` (host a trains on the even digits, host b on the odd ones)
and ``--tune``.

Needs root and ``ip netns`` (and ``tc`` for a shaped link); the namespaces are removed
at the end whatever happens, and no traffic leaves them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from shmtrain.bench.hosts.net import (  # noqa: F401 - re-exported: examples and tests use them from here
    NODES,
    PER_NODE,
    HostsUnavailable,
    host_env,
    launch,
    link_bytes,
    two_hosts,
    why_not,
)
from shmtrain.bench.hosts.rows import combine, pick, plot, print_table, rotated, summarize
from shmtrain.bench.hosts.settings import (  # noqa: F401 - re-exported: the CLI, examples and tests use them
    DEFAULT_METHODS,
    DEFAULTS,
    METHODS,
    ONE_HOST,
    QUICK,
    SETTINGS,
)


def grid_points(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every combination of the grid's values, as settings overrides (``[{}]``: none)."""
    keys = list(grid)
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*(grid[k] for k in keys))]


def method_points(grid: dict[str, Any], method: str) -> list[dict[str, Any]]:
    """``method``'s grid points: its own list (a per-method grid, ``{"*": [...], "diloco":
    [...]}``) or ``*``'s, or every combination of a plain grid (``{"lr": [...]}``)."""
    if "*" in grid:
        return list(grid.get(method, grid["*"]))
    return grid_points(grid)


def _budget(grid: dict[str, Any], methods: list[str]) -> int:
    """The number of trial runs per method; ValueError unless it is the same for each."""
    counts = {m: len(method_points(grid, m)) for m in methods}
    if len(set(counts.values())) > 1:
        raise ValueError(f"the grid gives the methods different budgets {counts}: give each the same number "
                         f"of points")
    return next(iter(counts.values()), 0)


#: the bench's own settings keys beside :data:`DEFAULTS`' (which reach every command as
#: fixed flags); any other key of a grid point is a method flag (``sync_every`` ->
#: ``--sync-every``)
_BENCH_KEYS = ("launcher", "grid", "preload", "own_lr")


def launcher(method: str, settings: dict[str, Any]) -> str:
    """``torchrun`` for DDP (what its users run); for shmtrain's methods the setting's
    ``launcher`` (default ``fork``: ``shmtrain torchrun``)."""
    return "torchrun" if METHODS[method] is None else settings.get("launcher", "fork")


def _worker_command(method: str, settings: dict[str, Any], out: Path) -> list[str]:
    """What each host's launcher runs: ``train ...`` (``-m shmtrain train ...`` under plain
    torchrun) or the DDP script; a grid point's method flags go last (they win)."""
    flags = METHODS[method]
    # untuned with no --lr: shmtrain's methods at their own defaults (the setting's, runtime/defaults.py)
    lr = [] if settings.get("own_lr") and flags is not None else ["--lr", str(settings["lr"])]
    common = ["--model", settings["model"], "--data", settings["data"], "--batch-size", str(settings["batch_size"]),
              *lr, "--iterations", str(settings["iterations"]),
              "--seed", str(settings["seed"]), "--eval-every", str(settings["eval_every"]),
              "--timeout", "60", "--out", str(out)]
    if settings.get("class_split"):
        common += ["--class-split", str(settings["class_split"])]
    if flags is None:
        return ["-m", "shmtrain.bench.hosts.ddp", *common]
    extra = [w for k, v in settings.items() if k not in DEFAULTS and k not in _BENCH_KEYS
             for w in (f"--{k.replace('_', '-')}", str(v))]
    head = ["train"] if launcher(method, settings) == "fork" else ["-m", "shmtrain", "train"]
    return [*head, *flags, *common, "--no-progress", "--checkpoint-every", "0",
            "--device", "cpu", *extra]  # the papers' CPU hosts (and the DDP baseline's)


def run_method(method: str, hosts: tuple[str, str, str], port: int, settings: dict[str, Any],
               out: Path, logs: Path, limit: float, name: str | None = None) -> dict[str, Any]:
    """One job of 2 workers per host (one host for ``one-host``); returns its row (times
    from the launch, link bytes counted). ``name``: of its logs (default the method)."""
    load = os.getloadavg()[0]  # the machine's load as the job starts (a shared machine's noise)
    nodes = 1 if method == ONE_HOST else NODES
    name = name or method
    extra = {"SHMTRAIN_PRELOAD": settings["preload"]} if settings.get("preload") else {}
    start, wall, link = launch(hosts, port, _worker_command(method, settings, out), logs, name, limit, nodes,
                               launcher(method, settings), extra)
    row = summarize(method, out, start, wall, settings["target"], link, PER_NODE,
                    [logs / f"{name}-node{n}.log" for n in range(nodes)])
    return dict(row, loadavg_1m=round(load, 2))


def _tune(methods: list[str], settings: dict[str, Any], job: Any, log: Any) -> tuple[dict[str, dict], dict[str, list]]:
    """One run of every method at each of its grid points (the i-th points of every method
    in the outer loop, so the machine's drift falls on every method); returns the chosen
    point per method and the trials (point, time to target, best accuracy)."""
    grid = settings.get("grid") or {}
    points = {m: method_points(grid, m) for m in methods}
    trials: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {m: [] for m in methods}
    for i in range(_budget(grid, methods)):
        for method in methods:
            point = points[method][i]
            label = "-".join(f"{k}{v}" for k, v in point.items())
            row = job(method, dict(settings, **point), f"tune/{method}-{label}")
            log(f"    tune {method} {point}: target at {row['time_to_target_s']} s, best {row['best_accuracy']}",
                flush=True)
            trials[method].append((point, row))
    chosen = {m: pick(trials[m]) for m in methods}
    kept = {m: [{"grid_point": p, "time_to_target_s": r["time_to_target_s"], "best_accuracy": r["best_accuracy"],
                 "final_accuracy": r["final_accuracy"]} for p, r in trials[m]] for m in methods}
    return chosen, kept


def run(methods: list[str], settings: dict[str, Any], rate: str, out: Path, limit: float, repeat: int = 1,
        log=print, tune: bool = False, point: int | None = None) -> dict[str, Any]:
    """Every method on one pair of namespaced hosts: with ``tune``, once per grid point
    first (or, with ``point`` K, at its K-th grid point, untuned); then ``repeat`` rounds,
    the order rotated per round; the JSON document."""
    reason = why_not(rate)
    if reason:
        raise HostsUnavailable(f"bench hosts cannot make two hosts here: {reason}")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    ports = itertools.count(29500)  # a fresh port per job: no wait for the last one's sockets
    with two_hosts(rate) as hosts:
        log(f"hosts: namespaces {hosts[0]}, {hosts[1]} (master {hosts[2]}), link "
            f"{'tbf ' + rate if rate != 'none' else 'unshaped'}; run folders under {out}")

        def job(method: str, chosen: dict[str, Any], name: str) -> dict[str, Any]:
            log(f"... {name}", flush=True)
            return run_method(method, hosts, next(ports), chosen, out / name, out / "logs", limit,
                              name.replace("/", "-"))

        if tune:
            chosen, trials = _tune(methods, settings, job, log)
        else:
            grid = settings.get("grid") or {}
            chosen = {m: method_points(grid, m)[point - 1] if point else {} for m in methods}
            trials = {}
        for round_ in range(repeat):
            for method in rotated(methods, round_):
                row = job(method, dict(settings, **chosen[method]),
                          method if repeat == 1 else f"{method}-r{round_ + 1}")
                log(f"    {method}: target at {row['time_to_target_s']} s, best accuracy {row['best_accuracy']}, "
                    f"iterations per host {row['iterations_per_host']}, comm {row['comm_ms']} ms/iter, "
                    f"link {row['link_mb']} MB, startup {row['startup_per_host_s']} s", flush=True)
                runs[method].append(row)
        namespaces = list(hosts[:2])
    command = None
    if sys.argv[1:3] == ["bench", "hosts"]:
        command = " ".join(["shmtrain", "bench", "hosts", *sys.argv[3:]])
    return {"bench": "hosts", "date": time.strftime("%Y-%m-%d"), "command": command, "rate": rate,
            "nodes": NODES, "workers_per_node": PER_NODE, "repeat": repeat, "settings": settings,
            "tuning": trials, "namespaces": namespaces,
            "rows": [combine(m, runs[m], {"grid_point": chosen[m]} if tune or point else None) for m in methods]}


def one_host_verdict(rows: list[dict[str, Any]], target: float) -> str | None:
    """A line on the one-host run: whether one host's shard alone reached the target."""
    row = next((r for r in rows if r["method"] == ONE_HOST), None)
    if row is None or row.get("best_accuracy") is None:
        return None
    if row["reached"]:
        return (f"one host alone reached {target:.0%} in {row['reached']}/{row['rounds']} rounds (best "
                f"{row['best_accuracy']:.4f}): this task does not need both hosts")
    return (f"one host alone cannot reach {target:.0%}: best held-out accuracy {row['best_accuracy']:.4f} "
            f"(its shard holds only its share of the classes); the task needs both hosts")


_RATE = re.compile(r"^\d+(\.\d+)?([kmgt]?bit|[kmgt]?bps)$", re.IGNORECASE)


def _jobs(args: argparse.Namespace) -> list[tuple[str, dict[str, Any], list[str], str, bool]]:
    """(name, settings, methods, rate, tune) of every setting the command asks for."""
    names = list(SETTINGS) if args.setting == ["all"] else (args.setting or [])
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        raise ValueError(f"--setting {unknown}: unknown; choose from {', '.join(SETTINGS)}, or all")
    jobs = []
    for name in names or [None]:
        preset = SETTINGS.get(name, {}) if name else {}
        settings = dict(DEFAULTS, **(QUICK if args.quick else {}),
                        **{k: v for k, v in preset.items() if k not in ("rate", "methods", "grid")})
        if args.model is not None and args.model != preset.get("model"):
            settings.pop("preload", None)
        for key in ("model", "data", "batch_size", "lr", "iterations", "eval_every", "target", "seed", "class_split"):
            if getattr(args, key) is not None:
                settings[key] = getattr(args, key)
        settings["launcher"] = args.launcher
        settings["grid"] = {"lr": args.grid_lr} if args.grid_lr else preset.get("grid", {"lr": [0.02, 0.05, 0.1]})
        methods = args.methods or preset.get("methods") or DEFAULT_METHODS
        rate = args.rate or preset.get("rate") or "1gbit"
        tune = (bool(name and not args.no_tune) or args.tune) and not args.grid_point
        # a setting untuned, no --lr: each shmtrain method at its own defaults (DDP at the setting's lr)
        settings["own_lr"] = bool(name and not tune and not args.grid_point and args.lr is None and not args.quick)
        jobs.append((name or "custom", settings, methods, rate, tune))
    return jobs


def _check(settings: dict[str, Any], methods: list[str], rate: str, repeat: int, point: int | None = None) -> None:
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"--methods {unknown}: unknown; choose from {', '.join(METHODS)}")
    if rate != "none" and not _RATE.match(rate):
        raise ValueError(f"--rate {rate!r}: a tc rate such as 1gbit or 100mbit, or none")
    if settings["iterations"] < 1 or settings["eval_every"] < 1 or settings["batch_size"] < 1:
        raise ValueError("--iterations, --eval-every and --batch-size must be at least 1")
    if not 0 < settings["target"] <= 1:
        raise ValueError(f"--target {settings['target']}: an accuracy in (0, 1]")
    if repeat < 1:
        raise ValueError(f"--repeat {repeat}: at least 1 round")
    budget = _budget(settings.get("grid") or {}, methods)
    if point is not None and not 1 <= point <= budget:
        raise ValueError(f"--grid-point {point}: the grid has {budget} points per method; give 1 to {budget}")


def _path(given: str | None, name: str, several: bool) -> Path | None:
    """Where a setting's JSON or plot goes: ``given``, or ``STEM-NAME.SUFFIX`` when the
    command runs several settings."""
    if not given:
        return None
    path = Path(given)
    return path.with_name(f"{path.stem}-{name}{path.suffix}") if several else path


def _handler(args: argparse.Namespace) -> int:
    jobs = _jobs(args)
    for _, settings, methods, rate, _ in jobs:
        _check(settings, methods, rate, args.repeat, args.grid_point)
    root = Path(args.out or f"runs/bench-hosts-{time.strftime('%Y%m%d-%H%M%S')}")
    if root.exists() and any(root.iterdir()):
        raise ValueError(f"--out {root}: not empty; give a new folder")
    limit = args.run_timeout or (180.0 if args.quick else 900.0)
    several = len(jobs) > 1
    for name, settings, methods, rate, tune in jobs:
        out = root / name if several else root
        try:
            doc = run(methods, settings, rate, out.resolve(), limit, args.repeat, tune=tune, point=args.grid_point)
        except RuntimeError as exc:  # a method's job failed: its logs are named, no traceback
            print(f"shmtrain: error: {exc}", file=sys.stderr)
            return 1
        doc["setting"] = name
        rows = doc["rows"]
        print(f"\n[{name}] time to {settings['target']:.0%} held-out accuracy of the job's model, "
              f"{settings['model']} on {settings['data']}"
              + (f" (--class-split {settings['class_split']})" if settings.get("class_split") else "")
              + f", {NODES} hosts x {PER_NODE} workers, batch {settings['batch_size']}/worker, "
              + (f"each method tuned on its {_budget(settings['grid'], methods)} grid points" if tune
                 else f"each method at its grid point {args.grid_point}, untuned" if args.grid_point
                 else f"each method at its own defaults (DDP lr {settings['lr']})" if settings.get("own_lr")
                 else f"lr {settings['lr']}")
              + f", link {rate}" + (f"; medians of {args.repeat} rounds:" if args.repeat > 1 else ":"))
        print(print_table(rows, args.repeat))
        verdict = one_host_verdict(rows, settings["target"])
        if verdict:
            print(verdict)
            doc["one_host_verdict"] = verdict
        if (path := _path(args.json, name, several)) is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(doc, indent=2) + "\n")
        if (path := _path(args.plot, name, several)) is not None:
            plot(rows, settings["target"], f"{name}: {settings['model'].rsplit(':')[-1]} on {settings['data']}, "
                 f"2 hosts x 2 workers, link {rate}", path)
    return 0


def add_parser(bench: argparse._SubParsersAction) -> None:
    """Register ``shmtrain bench hosts``."""
    p = bench.add_parser("hosts", help="time to accuracy across 2 namespaced hosts on a shaped link (root)",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", nargs="+", metavar="NAME",
                   help=f"a written-down comparison: {', '.join(SETTINGS)}, or all (each with its own JSON "
                        "and plot, STEM-NAME.json / .png)")
    p.add_argument("--methods", nargs="+", metavar="METHOD", help=f"from {' '.join(METHODS)} (default: the "
                   f"setting's, else {' '.join(DEFAULT_METHODS)})")
    p.add_argument("--target", type=float, help=f"held-out accuracy to reach (default {DEFAULTS['target']}; "
                                                f"--quick {QUICK['target']})")
    p.add_argument("--iterations", type=int, help=f"per worker (default {DEFAULTS['iterations']}; "
                                                  f"--quick {QUICK['iterations']})")
    p.add_argument("--eval-every", type=int, help=f"iterations between evaluations (default "
                                                  f"{DEFAULTS['eval_every']}; --quick {QUICK['eval_every']})")
    p.add_argument("--model", help=f"the model every method trains, as shmtrain train --model takes it "
                                   f"(default {DEFAULTS['model']})")
    p.add_argument("--data", help=f"the data set, as shmtrain train --data takes it (default {DEFAULTS['data']})")
    p.add_argument("--batch-size", type=int, help=f"per worker (default {DEFAULTS['batch_size']})")
    p.add_argument("--lr", type=float, help=f"learning rate of every method (default {DEFAULTS['lr']}; with "
                                            "--tune the grid's choice)")
    p.add_argument("--seed", type=int, help=f"the runs' --seed: weights, shards and data order (default "
                                            f"{DEFAULTS['seed']})")
    p.add_argument("--class-split", type=int, help="host k trains on the classes c with c mod N == k (default 0: "
                                                   "no split; the settings use 2)")
    p.add_argument("--rate", help="tc tbf rate of the link, both ways (default: the setting's, else 1gbit; "
                                  "none: unshaped)")
    p.add_argument("--launcher", choices=["fork", "torchrun"], default="fork",
                   help="what starts shmtrain's workers on each host: fork (`shmtrain torchrun`, torchrun forking "
                        "them from one process that imported torch) or torchrun (each worker a fresh interpreter); "
                        "DDP always runs under plain torchrun (default fork)")
    p.add_argument("--tune", action="store_true", help="run every method once per grid point first and use the "
                                                       "best (on by default with --setting)")
    p.add_argument("--no-tune", action="store_true", help="with --setting: no tuning; shmtrain's methods at "
                   "their own defaults (which the setting of hosts picks, docs/choosing_a_method.md) unless --lr "
                   "is given, DDP at --lr")
    p.add_argument("--grid-point", type=int, metavar="K", help="no tuning: every method at the K-th point of its "
                   "own grid (1-based; the setting's grid, SETTINGS in shmtrain/bench/hosts/command.py)")
    p.add_argument("--grid-lr", type=float, nargs="+", metavar="LR", help="the learning rates of the grid "
                   "(default: the setting's; else 0.02 0.05 0.1)")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of every method, order rotated per round; the table gives medians (default 1)")
    p.add_argument("--quick", action="store_true", help="the small variant (the tests run it)")
    p.add_argument("--out", help="run folders, one per method and round, tune/ and logs/ (default "
                                 "runs/bench-hosts-<time>)")
    p.add_argument("--run-timeout", type=float, help="seconds one job may take (default 900; --quick 180)")
    p.add_argument("--json", help="write the table, the settings, the tuning and the curves here")
    p.add_argument("--plot", help="write accuracy against wall time here (PNG)")
    p.set_defaults(handler=_handler)
