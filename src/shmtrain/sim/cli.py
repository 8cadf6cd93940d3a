"""``shmtrain sim allreduce``: the cost-model simulator on the command line.

Wiring (in :mod:`shmtrain.cli`)::

    from shmtrain.sim.cli import add_sim_parser
    add_sim_parser(sub)   # sets args.handler = run_sim_allreduce

Example (the paper's ResNet-50 and AlexNet gradients on 1024 nodes, 4 supernodes)::

    shmtrain sim allreduce --nodes 1024 --group-size 256 --bytes 97.7MB 232.6MB
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shmtrain.argtypes import comma_list
from shmtrain.fabric.allreduce.collectives.algorithms import ALGORITHMS
from shmtrain.sim.model import CostModel
from shmtrain.sim.simulate import format_table, parse_bytes, simulate_all


def _positive_int(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{value} must be at least 1 ({flag})")
        return value

    return parse


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return value


def add_sim_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``sim`` (with its ``allreduce`` command) to the top-level ``subparsers``."""
    defaults = CostModel()
    sim = subparsers.add_parser(
        "sim", help="cost-model simulator for scales this machine cannot run",
        description="Simulate collectives with the alpha-beta-gamma model (swCaffe Sec. V-A).",
    )
    commands = sim.add_subparsers(dest="sim_command", metavar="COMMAND", required=True)
    p = commands.add_parser(
        "allreduce", help="steps, bytes per link class and predicted time of each algorithm",
        description="Run each allreduce algorithm's schedule on a counting transport: latency "
        "steps, bytes sent per node inside and across groups (max over nodes, both phases) "
        "and the predicted time.",
    )
    p.add_argument("--nodes", type=_positive_int("--nodes"), required=True, metavar="P",
                   help="nodes P taking part in the allreduce, e.g. 1024")
    p.add_argument("--group-size", type=_positive_int("--group-size"), required=True, metavar="Q",
                   help="nodes per group (supernode, host); must divide --nodes")
    p.add_argument("--bytes", type=_size, nargs="+", required=True, metavar="N",
                   help="buffer size(s), e.g. 97.7MB 232.6MB (MB = 10^6 B, MiB = 2^20 B)")
    p.add_argument("--algorithms", type=comma_list("algorithm", ALGORITHMS), default=list(ALGORITHMS),
                   help=f"comma-separated subset of {','.join(ALGORITHMS)} (default: all)")
    p.add_argument("--itemsize", type=_positive_int("--itemsize"), default=4,
                   help="bytes per element (4: float32)")
    p.add_argument("--alpha", type=_seconds, default=defaults.alpha,
                   help=f"seconds per message (default {defaults.alpha:g})")
    p.add_argument("--beta-inside", type=_seconds, default=defaults.beta_inside,
                   help=f"seconds per byte inside a group (default {defaults.beta_inside:.3g})")
    p.add_argument("--beta-across", type=_seconds, default=defaults.beta_across,
                   help=f"seconds per byte across groups (default {defaults.beta_across:.3g})")
    p.add_argument("--gamma", type=_seconds, default=defaults.gamma,
                   help=f"seconds per reduced byte (default {defaults.gamma:.3g})")
    p.add_argument("--json", type=Path, metavar="FILE", help="write one row per algorithm here")
    p.set_defaults(handler=run_sim_allreduce)
    return sim


def run_sim_allreduce(args: argparse.Namespace) -> int:
    """Handler of ``shmtrain sim allreduce``: print the table, write JSON; exit status."""
    try:
        model = CostModel(
            alpha=args.alpha, beta_inside=args.beta_inside,
            beta_across=args.beta_across, gamma=args.gamma,
        )
        rows = []
        for nbytes in args.bytes:
            rows += simulate_all(args.nodes, args.group_size, nbytes, model,
                                 args.algorithms, args.itemsize)
    except ValueError as exc:
        print(f"shmtrain sim allreduce: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(format_table(rows, model))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([r.as_json() for r in rows], indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m shmtrain.sim.cli allreduce ...``) until cli.py wires it."""
    parser = argparse.ArgumentParser(prog="shmtrain")
    add_sim_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["sim", *(sys.argv[1:] if argv is None else argv)])
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
