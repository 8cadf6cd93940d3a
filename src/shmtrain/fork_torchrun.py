"""``shmtrain torchrun``: torchrun whose workers are forked from a process that imported torch once.

Each worker torchrun starts is a fresh interpreter: it imports torch, torch._dynamo (a
torch.optim optimizer's first use imports it) and shmtrain's worker path, 2.7 s of CPU
here, and torchrun's agent has imported torch already. On a host with 2 workers and 2
cores that is three imports before the first iteration, and across two hosts on one
machine six (start-up across hosts was 5.8-6.3 s from the launch on 2026-11-25).

``shmtrain torchrun [torchrun's options] train [train's options]`` is torchrun itself
(:mod:`torch.distributed.run`: its options, its rendezvous, its elastic agent, its
restarts) with two of its own options set: ``--start-method fork`` and ``--run-path``,
so that its agent forks each worker and runs :mod:`shmtrain.fork_worker` in it (Python's
signal defaults back, then ``shmtrain train`` or the script). Before the
agent starts, this process imports what every worker would (the zygote's list,
:data:`shmtrain.runtime.launch.zygote.PRELOAD`, the digits data set, and torchvision when the
``--model`` or ``--data`` needs it), so a worker begins with them loaded; the pages are
shared copy-on-write. A script path in place of ``train`` runs that script the same way
(a DDP script, as ``shmtrain run`` does on one host).

Why forking the agent is safe here (the zygote's rule, :mod:`shmtrain.runtime.launch.zygote`):
the agent has run no torch operation, so no OpenMP pool or autograd thread exists to be
copied half-way; its only threads are the rendezvous store's, which a child neither has
nor uses (a worker connects to the store as a client, as under plain torchrun).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

#: the shmtrain commands this launcher runs in its workers (others are a script path)
COMMANDS = ("train",)


def _flag(args: list[str], flag: str, default: str) -> str:
    """The value of ``flag`` in ``args`` (``--flag V`` or ``--flag=V``; the last wins), else ``default``."""
    value = default
    for i, word in enumerate(args):
        if word == flag and i + 1 < len(args):
            value = args[i + 1]
        elif word.startswith(flag + "="):
            value = word.split("=", 1)[1]
    return value


def preload(command: str, args: list[str]) -> None:
    """Import, once in this process, what each forked worker would
    (:func:`shmtrain.runtime.launch.zygote.preload_workers`: the zygote's list, the variable's
    modules, torchvision when ``train``'s ``--model`` or ``--data`` needs it, digits)."""
    from shmtrain.runtime.launch.zygote import PRELOAD_ENV, preload_workers
    from shmtrain.runtime.run.training import uses_torchvision

    extra = os.environ.get(PRELOAD_ENV, "")
    if command in COMMANDS:
        try:
            if uses_torchvision(_flag(args, "--model", ""), _flag(args, "--data", "digits")):
                extra += ",torchvision"
        except (ValueError, OSError):
            pass  # the worker reports the bad value itself
    preload_workers(extra, data=command in COMMANDS)


def parse(argv: list[str]) -> argparse.Namespace:
    """torchrun's own parser; refuses the options that cannot be forked (``-m``,
    ``--no-python``) with the fix."""
    from torch.distributed import run as torchrun

    parser = torchrun.get_args_parser()
    parser.prog = "shmtrain torchrun"
    parser.description = ("torchrun, with its workers forked from this process after it has imported torch and "
                          "shmtrain once (its --start-method fork and --run-path set): the same options, "
                          "rendezvous and restarts; give `train ARGS` (shmtrain train) or `SCRIPT ARGS`.")
    parser.epilog = ("example, on each of two hosts: shmtrain torchrun --nnodes 2 --node-rank $NODE "
                     "--nproc-per-node 2 --master-addr 10.0.0.1 --master-port 29500 train --strategy diloco "
                     "--inner host-sync --sync-every 10 --outer-dtype bf16")
    args = parser.parse_args(argv)
    for flag, given in (("--module/-m", args.module), ("--no-python", args.no_python)):
        if given:
            raise SystemExit(f"shmtrain torchrun: {flag} cannot be used: the workers are forked from this "
                             f"process and run `train` or a script path in it (give `train ...` or "
                             f"`path/to/script.py ...`, or use plain torchrun)")
    return args


def _workers(args: argparse.Namespace) -> int:
    """The job's workers as torchrun's options give them (the most nodes it may have)."""
    per_node = int(args.nproc_per_node) if str(args.nproc_per_node).isdigit() else 1
    nodes = str(args.nnodes).split(":")[-1]
    return per_node * (int(nodes) if nodes.isdigit() else 1)


def main(argv: list[str] | None = None) -> int:
    """``shmtrain torchrun [torchrun options] (train ... | SCRIPT ...)``."""
    args = parse(sys.argv[1:] if argv is None else argv)
    command = args.training_script
    if command not in COMMANDS and not Path(command).is_file():
        raise SystemExit(f"shmtrain torchrun: {command!r} is neither a shmtrain command ({', '.join(COMMANDS)}) "
                         f"nor a script file; give `train ...` or the path of a Python script")
    from shmtrain.runtime.launch.open_files import ensure_open_files

    try:  # before torchrun's agent makes a socket: a low ulimit -n fails there far from its cause
        ensure_open_files(_workers(args), f"--nproc-per-node {args.nproc_per_node} --nnodes {args.nnodes}")
    except ValueError as exc:
        print(f"shmtrain torchrun: error: {exc}", file=sys.stderr)
        return 2
    try:
        preload(command, args.training_script_args if command in COMMANDS else [])
    except KeyboardInterrupt:
        print("shmtrain torchrun: interrupted by SIGINT while importing; nothing was started", file=sys.stderr)
        return 130
    # each worker runs fork_worker.py (Python's signal defaults back, then the command or script)
    args.training_script = str(Path(__file__).with_name("fork_worker.py"))
    args.training_script_args = [command if command in COMMANDS else str(Path(command).resolve()),
                                 *args.training_script_args]
    args.run_path, args.start_method = True, "fork"
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun.run(args)
    except SignalException as exc:  # Ctrl-C / SIGTERM: the agent passed it to the workers, which stopped
        name = signal.Signals(exc.sigval).name
        print(f"shmtrain torchrun: stopped by {name} (the workers were sent it; none is left running)",
              file=sys.stderr)
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:  # torchrun's own report (it names the entrypoint run_script_path)
        print(exc.format_msg(), file=sys.stderr)
        what = "shmtrain train" if command in COMMANDS else command
        ranks = ", ".join(f"rank {r} (exit status {f.exitcode})" for r, f in sorted(exc.failures.items()))
        if command in COMMANDS:  # each rank printed its cause; one that lost a peer names it, not itself
            print(f"shmtrain torchrun: {what} ended with an error on this host ({ranks}); the cause each "
                  "rank found is its 'shmtrain: error:' line above (a rank that lost a peer names it by host "
                  "and rank)", file=sys.stderr)
        else:
            print(f"shmtrain torchrun: {what} failed on this host: {ranks}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
