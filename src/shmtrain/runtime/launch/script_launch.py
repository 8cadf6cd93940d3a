"""``shmtrain run``: one's own training script on N local workers, as torchrun runs it.

``shmtrain run --workers N script.py ARGS`` (or ``-m package.module ARGS``) starts N
workers through the launcher (``runtime/launch/launcher.py``: the zygote's fast start, the
store, the control block, the supervision). Each worker gets torchrun's environment
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``ROLE_RANK``, ``MASTER_ADDR``/``MASTER_PORT``: the launcher's store, listening on
loopback alone, served as torchrun's agent serves its own, ``TORCHELASTIC_USE_AGENT_STORE=True``), so
``init_process_group("gloo")`` with ``env://`` and :class:`shmtrain.DataParallel` join
the job as under torchrun, and the same script runs under either unchanged. The script
runs as ``__main__`` (``runtime/launch/script_worker.py``: ``runpy``; ``sys.argv = [script, *ARGS]``, ``sys.path[0]``
its
folder, as ``python script.py`` does) in its own session, as torchrun's workers are:
a terminal's Ctrl-C reaches the launcher, which passes it on to every worker once
(``launch(relay_signals=True)``; the worker target is
:func:`~shmtrain.runtime.launch.script_worker.run_script` itself, imported by name in each
worker as ``shmtrain train``'s is), waits for them to end (30 s, then kills them) and
exits 130 (SIGTERM: 143). Each worker's stderr goes to ``LOG_DIR/rank-<r>.log``
(appended; each launch adds a header line), its stdout to the terminal. The first worker
to fail is named with its cause or exit status and the last lines of its log; the others
are stopped; the exit status is the failing worker's (128 + N for signal N; 1 for a worker
that ended with status 0, ``sys.exit(0)`` mid-run, while the others still needed it: it is
named as having left the job early, not the peers that noticed).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import time
from pathlib import Path

#: lines of the failing worker's log quoted under the failure
TAIL_LINES = 10


# -- the launcher's side ---------------------------------------------------------------------------
def worker_env(workers: int) -> dict[str, str]:
    """torchrun's variables the launcher does not set for every launch, and the mark of a
    script's workers (``SHMTRAIN_SCRIPT``: they do not join the job before the script)."""
    return {
        "SHMTRAIN_SCRIPT": "1", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(workers),
        "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": secrets.token_hex(4),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        # env:// rendezvous then connects to the launcher's store at MASTER_PORT, as torchrun's
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def run_command(command: list[str], module: str | None, *, workers: int, threads: int = 1,
                log_dir: Path | None = None, verbose: bool = False, timeout: float = 120.0) -> int:
    """Run ``command`` (``[script, *args]``; or ``args`` of ``-m module``) on ``workers``
    local workers; return the exit status (see the module docstring)."""
    from shmtrain.runtime.launch.failures import exit_status
    from shmtrain.runtime.launch.launcher import StopNow, WorkerFailed, describe_exit, launch
    from shmtrain.runtime.launch.script_worker import run_script
    from shmtrain.runtime.outputs.worker_logs import mark

    if workers < 1:
        raise ValueError(f"--workers {workers}: at least 1 worker is needed")
    if module is None:
        if not command:
            raise ValueError("give the script to run: shmtrain run --workers 2 script.py ARGS "
                             "(or -m package.module ARGS)")
        script, args = command[0], command[1:]
        if not Path(script).is_file():
            raise ValueError(f"no such script: {script} (give the path of a Python file, or -m package.module)")
        name = Path(script).stem
    else:
        why = module_missing(module)
        if why and why.startswith("no module"):
            raise ValueError(f"-m {module}: {why} where python -m would look (this folder {os.getcwd()}, "
                             "PYTHONPATH, the installed packages); run from the folder that holds it, or give "
                             "the path of its file")
        if why:
            raise ValueError(f"-m {module}: {why}; name a module python -m can run")
        script, args, name = None, command, module
    log_dir = (Path(log_dir) if log_dir is not None else Path("shmtrain-logs") / name).absolute()
    header = f"--- shmtrain run {time.strftime('%Y-%m-%d %H:%M:%S')} (pid {os.getpid()}): " + " ".join(
        ["-m", module, *args] if module else [script or "", *args]) + " ---"
    mark(log_dir, workers, header)
    payload = {"script": script, "module": module, "args": args}
    try:
        launch(run_script, workers, payload, threads=threads, timeout=timeout, env=worker_env(workers),
               relay_signals=True, listen=True, log_dir=log_dir, verbose=verbose)
    except WorkerFailed as exc:
        print(f"shmtrain run: error: {exc}", file=sys.stderr)
        tail = _tail(log_dir / f"rank-{exc.rank}.log", header)
        if tail:
            print(f"the last lines of worker rank {exc.rank}'s log ({describe_exit(exc.returncode)}):",
                  file=sys.stderr)
            print("\n".join(f"  | {line}" for line in tail), file=sys.stderr)
        return exit_status(exc.returncode)
    except StopNow as exc:
        how = "at once (a second signal)" if exc.first else "once every worker had ended"
        print(f"shmtrain run: stopped by {_signame(exc.signum)} {how}; their logs: {log_dir}", file=sys.stderr)
        return 128 + exc.signum
    print(f"shmtrain run: {workers} worker(s) finished; their stderr: {log_dir}/rank-<r>.log", file=sys.stderr)
    return 0


def module_missing(module: str) -> str | None:
    """Why ``python -m module``, run from this folder, would not find ``module`` (None: it
    would), looked up without importing it or its packages: their code runs in the workers."""
    import importlib.util
    from importlib.machinery import PathFinder

    parts = module.split(".")
    if not all(part.isidentifier() for part in parts):
        return f"{module!r} is not a module name (dotted Python names, e.g. package.train)"
    try:
        spec = PathFinder.find_spec(parts[0], [os.getcwd(), *sys.path]) or importlib.util.find_spec(parts[0])
        for depth in range(1, len(parts) + 1):
            name = ".".join(parts[:depth])
            if spec is None:
                return f"no module named {name!r}"
            if depth == len(parts):
                break
            if spec.submodule_search_locations is None:
                return f"{name!r} is a module, not a package: it holds no {parts[depth]!r}"
            spec = PathFinder.find_spec(".".join(parts[:depth + 1]), list(spec.submodule_search_locations))
        if spec.submodule_search_locations is not None and PathFinder.find_spec(
                f"{module}.__main__", list(spec.submodule_search_locations)) is None:
            return f"{module!r} is a package without a __main__ module"
    except (ImportError, ValueError, AttributeError):
        return None  # a finder this lookup does not know: the worker's own import decides
    return None


def _signame(signum: int) -> str:
    import signal

    return signal.Signals(signum).name


def _tail(log: Path, header: str) -> list[str]:
    """The last :data:`TAIL_LINES` lines of ``log`` written after ``header`` (this launch's)."""
    try:
        text = log.read_bytes()[-65536:].decode(errors="replace")
    except OSError:
        return []
    lines = text.split(header, 1)[-1].splitlines() if header in text else text.splitlines()
    return [line for line in lines if line.strip()][-TAIL_LINES:]


RUN_EPILOG = """\
examples:
  shmtrain run --workers 2 examples/ddp_script.py --steps 200 --ckpt /tmp/ddp.pt
  shmtrain run --workers 4 -m mypackage.train --lr 0.1        a module, as python -m runs it
  torchrun --nproc-per-node 2 examples/ddp_script.py ...      the same script, unchanged

Each worker runs SCRIPT as __main__ with sys.argv = [SCRIPT, *ARGS] and torchrun's
environment: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK=0, ROLE_RANK,
MASTER_ADDR=127.0.0.1, MASTER_PORT (a free loopback port) and TORCHELASTIC_*: so
torch.distributed.init_process_group("gloo") and shmtrain.DataParallel(...) join the job.
Output: every worker's stdout goes to this terminal; its stderr (warnings, tracebacks)
to LOG_DIR/rank-<r>.log (default shmtrain-logs/<script name>/; appended, each launch
headed by a '--- shmtrain run ...' line), and with --verbose to this terminal as well.
Failures: the first worker to fail is named with its cause or exit status and the last
lines of its log, and the others are stopped (SIGKILL of one worker too); the exit status
is that worker's (an exception: 1; killed by signal N: 128 + N; a worker that left early
with sys.exit(0) while the others needed it: 1). Ctrl-C (or SIGTERM)
is passed on to every worker once, they have 30 s to end (e.g. save a checkpoint), then
are killed; the exit status is 130 (SIGTERM: 143); Ctrl-C again kills them at once.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``shmtrain run [--workers N] SCRIPT ARGS | -m MODULE ARGS``."""
    p = sub.add_parser(
        "run", help="run your own training script on N local workers (a torchrun for one host)",
        description="Run your own training script (or -m module) on N local worker processes, "
                    "each with torchrun's environment, started by shmtrain's fast launcher.",
        epilog=RUN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="shmtrain run [--workers N] [options] SCRIPT [ARGS ...] | -m MODULE [ARGS ...]",
    )
    p.add_argument("--workers", type=int, default=2, metavar="N", help="worker processes (default 2)")
    p.add_argument("--threads", type=int, default=1, metavar="T",
                   help="torch threads per worker (OMP_NUM_THREADS; default 1)")
    p.add_argument("--log-dir", metavar="DIR",
                   help="where each worker's stderr goes, as rank-<r>.log (default shmtrain-logs/<script name>)")
    p.add_argument("--verbose", action="store_true", help="copy the workers' stderr to this terminal too")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="seconds the workers wait for the launcher's store, and shmtrain.DataParallel "
                        "for a peer (SHMTRAIN_TIMEOUT; default 120)")
    p.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE ARGS",
                   help="run a module as python -m does (what follows is its arguments)")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="SCRIPT ARGS",
                   help="the script and its arguments (everything after SCRIPT is the script's)")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    if args.module is not None:
        if not args.module:
            raise ValueError("-m needs a module name: shmtrain run --workers 2 -m package.module ARGS")
        if args.command:
            raise ValueError(f"give a script or -m MODULE, not both ({args.command[0]} and -m {args.module[0]})")
        module, command = args.module[0], args.module[1:]
    else:
        module, command = None, args.command
    return run_command(command, module, workers=args.workers, threads=args.threads,
                       log_dir=Path(args.log_dir) if args.log_dir else None, verbose=args.verbose,
                       timeout=args.timeout)
