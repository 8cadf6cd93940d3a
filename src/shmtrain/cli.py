"""The command line: ``shmtrain train | run | compare | bench | sim | experiment | reproduce``."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import signal
import sys
import typing
from typing import Any

TRAIN_EPILOG = """\
examples:
  shmtrain train                                   small CNN on digits, 4 workers, ssgd
  shmtrain train --strategy single --workers 1 --batch-size 128
  shmtrain train --model resnet18 --data synthetic --input-shape 3x64x64 --workers 2 --iterations 20
  shmtrain train --data path/to/images --image-size 32 --epochs 5
  shmtrain train --config run.toml --lr 0.1        TOML keys are the flag names; flags win
  shmtrain train --task regression --data mypkg.data:table --model mypkg.nets:Net   MSE, rmse (docs/tasks.md)
  shmtrain train --task language-model --data examples.lm_text:stdlib_text --model examples.lm_text:Net
  shmtrain train --keep-best loss --early-stop loss:3   RUN_DIR/best.pt; stop once 3 evaluations gain nothing
  shmtrain evaluate runs/my-run                    the task's metrics of its model.pt
  torchrun --nnodes 2 --nproc-per-node 2 ... -m shmtrain train   one worker per torchrun process
  shmtrain train --lr 0.1 --lr-schedule cosine --warmup-iterations 50 --eval-every 100
  shmtrain train --lr-schedule step --lr-step-every 200 --lr-gamma 0.5
  shmtrain train --iterations 50 --trace --tensorboard   then open RUN_DIR/trace.json in ui.perfetto.dev,
                                                   or run tensorboard --logdir RUN_DIR/tensorboard
  shmtrain compare runs/a runs/b                   two finished runs side by side
  shmtrain train --checkpoint-every 500 --out runs/long   then Ctrl-C: the workers save and stop
  shmtrain train --resume runs/long --iterations 5000     continue in place, to a new total
  shmtrain train --max-restarts 3                  a worker dies: restart all from the latest checkpoint

The run folder (--out, default runs/<time>-<strategy>) gets config.toml, metrics/rank-<r>.jsonl
(one line per iteration: iteration, loss, lr, t0 (start, seconds since the epoch), time per phase
in seconds; rank 0's file also has {"eval": {iteration, loss, accuracy, ...}} rows: the task's
metrics), summary.json, model.pt and plot.png (loss, the held-out metric, compute vs
communication), logs/rank-<r>.log; with --keep-best best.pt; with --trace
trace.json, with --tensorboard tensorboard/, and checkpoints/step-<N>/ (every rank's state) with
checkpoints/latest. Threads: each worker uses --threads torch threads
(default 1) plus a prefetch thread that mostly sleeps; with more workers than cores, workers
time-share and waiting ones sleep.

Trust: a --config file, and a run folder (--resume, evaluate, compare) with every file read
from it, is used only when you (or root) own it and not every user can write it, since the
module:callable values of a config are imported and called and its checkpoints loaded
(with torch.load(weights_only=True): tensors and numbers, never unpickled objects). To use
another user's, list it in SHMTRAIN_TRUSTED (paths separated by ':', each trusting itself and
what lies under it; '*' trusts every path), e.g.
  SHMTRAIN_TRUSTED=/home/alice/runs/a shmtrain evaluate /home/alice/runs/a
"""


def _add_train(sub: argparse._SubParsersAction) -> None:
    """Register ``shmtrain train``: one flag per TrainConfig field (grouped by section),
    ``--config FILE``, and one flag per strategy option."""
    from shmtrain.runtime.config import SECTIONS, TrainConfig, train_fields

    p = sub.add_parser(
        "train", help=COMMANDS["train"][0],
        description="Train a model data-parallel over local workers (or as one torchrun worker).",
        epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )
    groups = {key: p.add_argument_group(title) for key, title in SECTIONS.items()}
    hints = typing.get_type_hints(TrainConfig)
    for f in train_fields():
        _add_field_flag(groups[f.metadata["section"]], f, hints[f.name])
    groups["job"].add_argument(
        "--config", metavar="FILE",
        help="TOML file with the same keys as these flags (flags win); yours, or listed in "
             "SHMTRAIN_TRUSTED (see below) (default none)",
    )
    groups["job"].add_argument(
        "--resume", metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its newest whole checkpoint, in place, to the total "
             "that --iterations/--epochs give (default: the run's own); the configuration is "
             "RUN_DIR/config.toml, other flags must agree with it; RUN_DIR is yours, or listed in "
             "SHMTRAIN_TRUSTED (see below) (default none)",
    )
    groups["job"].add_argument(
        "--restart-schedule", action="store_true",
        help="with --resume to another length: a new learning-rate schedule (cosine, or step without "
             "--lr-step-every) over the iterations left, its --warmup-iterations warm-up first and then "
             "from the peak --lr, instead of the run's, which "
             "was drawn over its planned length (a resume that would not follow it is refused without "
             "this) (default off)",
    )
    _add_strategy_options(p)
    p.set_defaults(handler=_train)


def _add_field_flag(g: argparse._ArgumentGroup, f: dataclasses.Field, hint: Any) -> None:
    """The flag of one TrainConfig field, from its annotation and its metadata."""
    from shmtrain.typed_options import hint_kind

    meta = f.metadata
    flag = meta.get("flag", "--" + f.name.replace("_", "-"))
    text = meta["help"]
    if "names" in meta:
        text = f"{text}: {', '.join(meta['names']())}"
    text = f"{text} (default {meta.get('default_text', f.default)})"
    kwargs: dict[str, Any] = {"dest": f.name, "help": text.replace("%", "%%")}
    kind, choices = hint_kind(hint)
    if "action" in meta:
        kwargs["action"] = meta["action"]
    elif kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
    else:
        kwargs["type"] = kind
        if choices:
            kwargs["choices"] = choices
    if "metavar" in meta:
        kwargs["metavar"] = meta["metavar"]
    g.add_argument(flag, **kwargs)


def _add_strategy_options(p: argparse.ArgumentParser) -> None:
    """One flag per field of every strategy's Config (shared names share one flag)."""
    from shmtrain import strategies
    from shmtrain.typed_options import hint_kind

    seen: dict[str, tuple[list[str], dataclasses.Field, Any]] = {}
    for name, cls in sorted(strategies.registry().items()):
        hints = typing.get_type_hints(cls.Config)
        for f in dataclasses.fields(cls.Config):
            if f.name in seen:
                seen[f.name][0].append(name)
            else:
                seen[f.name] = ([name], f, hints.get(f.name, str))
    if not seen:
        return
    g = p.add_argument_group("strategy options (each applies to the strategies named)")
    for field_name, (owners, f, hint) in sorted(seen.items()):
        flag = "--" + field_name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        doc = f.metadata.get("help", "") if f.metadata else ""
        text = f"{doc} [{', '.join(owners)}; default {default}]".strip().replace("%", "%%")
        kind, choices = hint_kind(hint)
        if kind is bool:
            g.add_argument(flag, dest=field_name, action="store_true", help=text)
        else:
            g.add_argument(flag, dest=field_name, type=kind, choices=choices, help=text)


def _train(args: argparse.Namespace) -> int:
    from shmtrain.runtime.config import read_toml, resolve
    from shmtrain.runtime.run.training import run_training

    values = vars(args).copy()
    for key in ("handler", "command"):
        values.pop(key, None)
    config_file = values.pop("config", None)
    resume_dir = values.pop("resume", None)
    restart_schedule = bool(values.pop("restart_schedule", False))
    merged = read_toml(config_file) if config_file else {}
    merged.update(values)
    if resume_dir is not None:
        from shmtrain.runtime.checkpoint.files import resume_config

        config = resume_config(resume_dir, merged)  # RUN_DIR/config.toml + the run length
    else:
        config = resolve(merged)
    summary = run_training(config, resume=resume_dir is not None, restart_schedule=restart_schedule)
    return 0 if summary is None or summary.get(summary.get("metric", "accuracy")) is not None else 1


COMPARE_EPILOG = """\
examples:
  shmtrain compare runs/20261122-101500-ssgd runs/20261122-102200-seasgd
  shmtrain compare runs/* --out docs/compare.png

Each RUN_DIR is a folder a finished `shmtrain train` wrote (its --out): the table comes from
its summary.json (the metric is the task's final held-out one: accuracy, rmse or perplexity;
ms columns are the mean time per iteration of each phase over workers and iterations, the first
iteration left out), the curves from metrics/rank-0.jsonl (training loss per iteration; the
held-out metric from the --eval-every rows, or the final value as one point when the run has
none). A RUN_DIR of another user is refused unless SHMTRAIN_TRUSTED lists it (see shmtrain
train --help: Trust).
"""


def _add_compare(sub: argparse._SubParsersAction) -> None:
    """Register ``shmtrain compare RUN_DIR... [--out FILE]``."""
    p = sub.add_parser(
        "compare", help=COMMANDS["compare"][0],
        description="Compare finished runs of `shmtrain train`: print their summaries side by side "
                    "(strategy, workers, iterations, held-out metric, wall time, ms per phase) and plot "
                    "their loss and held-out metric (accuracy, rmse, perplexity) curves in one figure.",
        epilog=COMPARE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders written by shmtrain train (its --out)")
    p.add_argument("--out", default="compare.png", metavar="FILE",
                   help="where the figure goes (default compare.png in the current folder)")
    p.set_defaults(handler=_compare)


def _compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from shmtrain.runtime.outputs.compare import compare

    compare([Path(r) for r in args.runs], Path(args.out))
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from shmtrain.bench import (
        allreduce,
        chaos,
        checkpoint,
        collectives,
        floors,
        fsdp,
        ops,
        overlap,
        ps,
        smb,
        step,
        subbatch,
    )
    from shmtrain.bench.compress import add_bench_compress_parser
    from shmtrain.bench.hosts.command import add_parser as add_bench_hosts_parser
    from shmtrain.bench.lightning_peers import add_bench_lightning_parser

    p = sub.add_parser("bench", help=COMMANDS["bench"][0],
                       description="Benchmarks: each prints a table and writes --json.")
    bench = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    allreduce.add_parser(bench)
    step.add_parser(bench)
    add_bench_hosts_parser(bench)
    collectives.add_bench_collectives_parser(bench)
    smb.add_bench_smb_parser(bench)
    smb.add_bench_seasgd_parser(bench)
    ps.add_bench_ps_parser(bench)
    overlap.add_bench_overlap_parser(bench)
    checkpoint.add_bench_checkpoint_parser(bench)
    subbatch.add_bench_subbatch_parser(bench)
    add_bench_compress_parser(bench)
    add_bench_lightning_parser(bench)
    floors.add_parser(bench)
    ops.add_parser(bench)
    fsdp.add_parser(bench)
    chaos.add_parser(bench)


def _add_experiment(sub: argparse._SubParsersAction) -> None:
    from shmtrain.experiments import hpsearch, neuron

    p = sub.add_parser("experiment", help=COMMANDS["experiment"][0],
                       description="Experiments of the SHM-Learn-Dist paper: each writes PNG plots and a JSON "
                                   "into --out.")
    experiments = p.add_subparsers(dest="experiment", metavar="EXPERIMENT", required=True)
    neuron.add_experiment_parsers(experiments)
    hpsearch.add_experiment_parsers(experiments)


REPRODUCE_EPILOG = """\
examples:
  shmtrain reproduce --list                        every NAME, its paper and claim
  shmtrain reproduce trl-table3 --quick            under 2 minutes here; writes ./reproduction/
  shmtrain reproduce shmcaffe-table2 --out docs/reproduction
  shmtrain reproduce all --quick --out /tmp/r      every one in turn

Each NAME writes NAME.md (the paper's figures beside ours, the ratio that can be compared,
the verdict, and why the absolute figures differ), NAME.json and NAME.png into --out.
The runs are scaled down to this machine (digits or synthetic inputs shaped like the
paper's, 2-4 workers); docs/reproduction/README.md has the full runs and their verdicts.
"""


def _add_reproduce(sub: argparse._SubParsersAction) -> None:
    """Register ``shmtrain reproduce [--list] NAME [--quick] [--out DIR]``."""
    p = sub.add_parser(
        "reproduce", help=COMMANDS["reproduce"][0],
        description="Re-run a headline result of the five papers on this machine, scaled down, "
                    "and write the paper's figures beside ours.",
        epilog=REPRODUCE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", nargs="?", metavar="NAME", help="a reproduction (see --list), or all")
    p.add_argument("--list", action="store_true", help="list the reproductions and exit")
    p.add_argument("--quick", action="store_true",
                   help="the small variant (under 2 minutes each here; the tests run it)")
    p.add_argument("--out", default="reproduction", metavar="DIR",
                   help="where NAME.md, NAME.json and NAME.png go (default ./reproduction)")
    p.set_defaults(handler=_reproduce)


def _reproduce(args: argparse.Namespace) -> int:
    from pathlib import Path

    from shmtrain.reproduce.core import get, registry, run_reproduction

    if args.list or args.name is None:
        for repro in registry().values():
            print(f"{repro.name:<20} {repro.paper}\n{'':<20} {repro.claim}")
        if args.name is None and not args.list:
            print("shmtrain: give a NAME from the list above (or all)", file=sys.stderr)
            return 2
        return 0
    names = list(registry()) if args.name == "all" else [get(args.name).name]
    out = Path(args.out)
    failed = []
    for name in names:
        print(f"shmtrain reproduce {name}{' --quick' if args.quick else ''} ...", flush=True)
        doc = run_reproduction(name, out, quick=args.quick, log=lambda m: print(f"  {m}", flush=True))
        print(f"  verdict: {doc['verdict']}; wrote {out / name}.md, .json, .png ({doc['seconds']} s)")
        for claim in doc["claims"]:
            mark = "holds" if claim["holds"] else "DOES NOT HOLD"
            print(f"  - {claim['what']}: paper {claim['paper']}, ours {claim['ours']} ({mark})")
            if claim["rule"] and not claim["holds"]:
                failed.append(f"{name}: {claim['what']}")
    if failed:
        print(f"shmtrain: {len(failed)} claim(s) did not hold: {'; '.join(failed)}", file=sys.stderr)
    return 0


def _add_torchrun(sub: argparse._SubParsersAction) -> None:
    sub.add_parser(  # dispatched before parsing (its options are torchrun's): see _main
        "torchrun", help=COMMANDS["torchrun"][0],
        description="torchrun [its options] train ... | SCRIPT ...: torchrun's agent imports torch and "
                    "shmtrain once and forks each worker (--start-method fork --run-path); "
                    "`shmtrain torchrun --help` lists torchrun's options", add_help=False)


#: every sub-command: its one-line help (what ``shmtrain --help`` lists) and what registers
#: its whole parser (a function, or ``"module:function"`` imported only then), which may
#: import torch (``train`` imports every strategy for its flags)
COMMANDS: dict[str, tuple[str, Any]] = {
    "train": ("train a model data-parallel", _add_train),
    "run": ("run your own training script on N local workers (a torchrun for one host)",
            "shmtrain.runtime.launch.script_launch:add_parser"),
    "torchrun": ("torchrun, its workers forked from one process per host (start-up across hosts)", _add_torchrun),
    "compare": ("finished runs side by side: a table and loss/metric curves", _add_compare),
    "evaluate": ("a trained model's held-out metrics (run folder, model file or checkpoint)",
                 "shmtrain.runtime.evaluate:add_parser"),
    "bench": ("benchmarks (table + JSON)", _add_bench),
    "sim": ("cost-model simulator for scales this machine cannot run", "shmtrain.sim.cli:add_sim_parser"),
    "experiment": ("the papers' experiments (plots + JSON)", _add_experiment),
    "reproduce": ("re-run one of the papers' headline results (md + json + png)", _add_reproduce),
    "smb-server": ("run a memory server for workers on several hosts (SMB-REMOTE)",
                   "shmtrain.runtime.launch.smb_server:add_parser"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``shmtrain`` parser. ``command`` None: every sub-command whole; a name: that one
    whole and the others by name and help only (what parsing its words needs: ``shmtrain
    smb-server ...`` or ``shmtrain --help`` does not wait seconds for torch to import); "":
    every one by name and help only."""
    from shmtrain import __version__

    parser = argparse.ArgumentParser(
        prog="shmtrain",
        description="Data-parallel training on PyTorch through shared-memory parameter buffers.",
    )
    parser.add_argument("--version", action="version", version=f"shmtrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (text, register) in COMMANDS.items():
        if command is None or command == name:
            if isinstance(register, str):
                module, _, function = register.partition(":")
                register = getattr(importlib.import_module(module), function)
            register(sub)
        else:
            sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; the exit status (2: bad input, 1: a worker failed, 128 + the
    signal: stopped by SIGHUP, SIGINT or SIGTERM)."""
    try:
        return _main(argv)
    except KeyboardInterrupt as exc:  # Ctrl-C while importing, parsing or checking the input
        name = signal.Signals(getattr(exc, "signum", signal.SIGINT)).name
        print(f"shmtrain: interrupted by {name}; no worker is left running", file=sys.stderr)
        return 128 + getattr(exc, "signum", signal.SIGINT)


def _main(argv: list[str] | None) -> int:
    words = sys.argv[1:] if argv is None else argv
    if words[:1] == ["torchrun"]:  # torchrun's own options and parser (docs/hosts.md)
        from shmtrain.fork_torchrun import main as fork_torchrun

        return fork_torchrun(words[1:])
    launches = words[:1] in (["train"], ["run"], ["bench"], ["reproduce"], ["experiment"])
    if launches and not {"-h", "--help"} & set(words):
        from shmtrain.runtime.launch import zygote

        zygote.prestart()  # the workers' torch imports while this process builds its parser
    parser = build_parser(words[0] if words[:1] and words[0] in COMMANDS else "")
    args = parser.parse_args(words)
    try:
        return int(args.handler(args) or 0)
    except Exception as exc:
        if _raised(exc, "shmtrain.runtime.run.end", "RunStopped"):  # Ctrl-C / SIGTERM: what was saved, how to go on
            if str(exc):
                print(f"shmtrain: {exc}", file=sys.stderr)
            return exc.code  # type: ignore[attr-defined]
        if isinstance(exc, ValueError):
            print(f"shmtrain: error: {exc}", file=sys.stderr)
            return 2
        if any(_raised(exc, module, name) for module, name in _FAILURES):
            print(f"shmtrain: error: {exc}", file=sys.stderr)
            return 1
        raise


#: the failures that end a command with status 1 and their one line (a worker's, a peer's,
#: the disk's, a diverged loss), by module: looked up only once that module was imported
_FAILURES = (("shmtrain.fabric.shm.control", "PeerFailure"), ("shmtrain.fabric.shm.control", "PeerTimeout"),
             ("shmtrain.runtime.checkpoint.files", "CheckpointError"), ("shmtrain.runtime.files", "OutputError"),
             ("shmtrain.runtime.launch.failures", "WorkerFailed"),
             ("shmtrain.runtime.train.finite", "TrainingDiverged"))


def _raised(exc: BaseException, module: str, name: str) -> bool:
    """Whether ``exc`` is an instance of ``module.name``, without importing ``module``: an
    exception of a class whose module was never imported cannot have been raised."""
    cls = getattr(sys.modules.get(module), name, None)
    return isinstance(cls, type) and isinstance(exc, cls)

if __name__ == "__main__":
    sys.exit(main())
