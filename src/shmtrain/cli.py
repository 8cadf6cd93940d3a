"""The command line: ``shmtrain train | bench | sim | experiment``."""

from __future__ import annotations

import argparse
import dataclasses
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
  torchrun --nnodes 2 --nproc-per-node 2 ... -m shmtrain train   one worker per torchrun process

The run folder (--out, default runs/<time>-<strategy>) gets config.toml, metrics/rank-<r>.jsonl
(one line per iteration: iteration, loss, time per phase in seconds), summary.json, model.pt and
plot.png. Threads: each worker uses --threads torch threads (default 1) plus a prefetch thread
that mostly sleeps; with more workers than cores, workers time-share and waiting ones sleep.
"""


def _add_train(sub: argparse._SubParsersAction) -> None:
    """Register ``shmtrain train``: one flag per TrainConfig field (grouped by section),
    ``--config FILE``, and one flag per strategy option."""
    from shmtrain.runtime.config import SECTIONS, TrainConfig, train_fields

    p = sub.add_parser(
        "train", help="train a model data-parallel",
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
        help="TOML file with the same keys as these flags (flags win) (default none)",
    )
    _add_strategy_options(p)
    p.set_defaults(handler=_train)


def _add_field_flag(g: argparse._ArgumentGroup, f: dataclasses.Field, hint: Any) -> None:
    """The flag of one TrainConfig field, from its annotation and its metadata."""
    from shmtrain.runtime.config import hint_kind

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
    from shmtrain.runtime.config import hint_kind

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
    from shmtrain.runtime.run import run_training

    values = vars(args).copy()
    for key in ("handler", "command"):
        values.pop(key, None)
    config_file = values.pop("config", None)
    merged = read_toml(config_file) if config_file else {}
    merged.update(values)
    config = resolve(merged)
    summary = run_training(config)
    return 0 if summary is None or summary.get("accuracy") is not None else 1


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from shmtrain.bench import allreduce, collectives, overlap, ps, smb, step

    p = sub.add_parser("bench", help="benchmarks (table + JSON)", description="Benchmarks: each prints a table and writes --json.")
    bench = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    allreduce.add_parser(bench)
    step.add_parser(bench)
    collectives.add_bench_collectives_parser(bench)
    smb.add_bench_smb_parser(bench)
    smb.add_bench_seasgd_parser(bench)
    ps.add_bench_ps_parser(bench)
    overlap.add_bench_overlap_parser(bench)


def _add_experiment(sub: argparse._SubParsersAction) -> None:
    from shmtrain.experiments import hpsearch, neuron

    p = sub.add_parser("experiment", help="the papers' experiments (plots + JSON)",
                       description="Experiments of the SHM-Learn-Dist paper: each writes PNG plots and a JSON into --out.")
    experiments = p.add_subparsers(dest="experiment", metavar="EXPERIMENT", required=True)
    neuron.add_experiment_parsers(experiments)
    hpsearch.add_experiment_parsers(experiments)


def build_parser() -> argparse.ArgumentParser:
    """The ``shmtrain`` parser with every sub-command."""
    from shmtrain import __version__

    parser = argparse.ArgumentParser(
        prog="shmtrain",
        description="Data-parallel training on PyTorch through shared-memory parameter buffers.",
    )
    parser.add_argument("--version", action="version", version=f"shmtrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_train(sub)
    _add_bench(sub)
    from shmtrain.sim.cli import add_sim_parser

    add_sim_parser(sub)
    _add_experiment(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; the exit status (2: bad input, 1: a worker failed)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from shmtrain.fabric.control import PeerFailure, PeerTimeout
    from shmtrain.runtime.launcher import WorkerFailed

    try:
        return int(args.handler(args) or 0)
    except ValueError as exc:
        print(f"shmtrain: error: {exc}", file=sys.stderr)
        return 2
    except (WorkerFailed, PeerFailure, PeerTimeout) as exc:
        print(f"shmtrain: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("shmtrain: interrupted; every worker has been stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
