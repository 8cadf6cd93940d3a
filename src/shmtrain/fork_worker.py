"""What each worker that ``shmtrain torchrun`` forks runs first (torchrun's ``--run-path``
runs this file as ``__main__``; :mod:`shmtrain.fork_torchrun`).

A forked worker inherits its agent's signal handlers: torchrun's agent turns SIGINT,
SIGTERM, SIGHUP and SIGQUIT into its own ``SignalException``. A worker that torchrun
starts as a fresh interpreter has Python's defaults instead (SIGINT raises
KeyboardInterrupt, the others end the process), and a script or ``shmtrain train`` must
see the same under both launchers. So this restores those defaults, then runs
``shmtrain train ARGS`` or the script ``PATH ARGS`` (``sys.argv[1:]``) as ``__main__``.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys


def restore_signals() -> None:
    """The signal dispositions of a fresh Python interpreter."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


def main() -> None:
    restore_signals()
    target, args = sys.argv[1], sys.argv[2:]
    if target == "train":
        from shmtrain.cli import main as cli_main

        sys.argv = ["shmtrain", target, *args]
        code = cli_main([target, *args])
        if code:
            sys.exit(code)
        return
    sys.argv = [target, *args]
    sys.path.insert(0, os.path.dirname(target))  # as `python SCRIPT` has it: the script's siblings import
    runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
