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
    from shmtrain import strategies
    from shmtrain.models import model_names
    from shmtrain.runtime.config import TrainConfig

    defaults = TrainConfig.__dataclass_fields__
    p = sub.add_parser(
        "train", help="train a model data-parallel",
        description="Train a model data-parallel over local workers (or as one torchrun worker).",
        epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )

    def default(name: str) -> Any:
        return defaults[name].default

    g = p.add_argument_group("job")
    g.add_argument("--strategy", help=f"how workers share parameters: {', '.join(sorted(strategies.registry()))} (default {default('strategy')})")
    g.add_argument("--workers", type=int, help=f"local worker processes (default {default('workers')}; ignored under torchrun)")
    g.add_argument("--threads", type=int, help=f"torch threads per worker (default {default('threads')})")
    g.add_argument("--config", help="TOML file with the same keys as these flags (flags win)")
    g.add_argument("--out", help="run folder (default runs/<time>-<strategy>)")
    g.add_argument("--timeout", type=float, help=f"seconds to wait for a peer before failing (default {default('timeout')})")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress line")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", help=f"{', '.join(model_names())} (default {default('model')})")
    g.add_argument("--data", help="digits, synthetic, or a folder with one sub-folder of images per class (default digits)")
    g.add_argument("--input-shape", help=f"CxHxW of synthetic data (default {default('input_shape')})")
    g.add_argument("--samples", type=int, help=f"synthetic samples (default {default('samples')})")
    g.add_argument("--image-size", type=int, help=f"side images of a folder are resized to (default {default('image_size')})")
    g.add_argument("--prefetch", type=int, help=f"batches the prefetch thread keeps ready (default {default('prefetch')})")
    g = p.add_argument_group("optimisation (SGD)")
    g.add_argument("--batch-size", type=int, help=f"per worker, the papers' convention (default {default('batch_size')})")
    g.add_argument("--lr", type=float, help=f"learning rate (default {default('lr')})")
    g.add_argument("--momentum", type=float, help=f"(default {default('momentum')})")
    g.add_argument("--weight-decay", type=float, help=f"(default {default('weight_decay')})")
    g.add_argument("--iterations", type=int, help="iterations per worker")
    g.add_argument("--epochs", type=float, help="epochs over the sharded data (default 20 when neither is given)")
    g.add_argument("--seed", type=int, help="makes a run repeatable (default 0)")
    _add_strategy_options(p)
    p.set_defaults(handler=_train)


def _add_strategy_options(p: argparse.ArgumentParser) -> None:
    """One flag per field of every strategy's Config (shared names share one flag)."""
    from shmtrain import strategies

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
        text = f"{doc} [{', '.join(owners)}; default {default}]".strip()
        if hint is bool:
            g.add_argument(flag, dest=field_name, action="store_true", help=text)
        else:
            g.add_argument(flag, dest=field_name, type=_scalar(hint), help=text)


def _scalar(hint: Any):
    for kind in (int, float, str):
        if hint is kind or kind in typing.get_args(hint):
            return kind
    return str


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
