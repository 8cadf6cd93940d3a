"""What each worker that ``shmtrain torchrun`` forks runs first (torchrun's ``--run-path``
runs this file as ``__main__``; :mod:`shmtrain.fork_torchrun`).

A forked worker inherits its agent's signal handlers: torchrun's agent turns SIGINT,
SIGTERM, SIGHUP and SIGQUIT into its own ``SignalException``. A worker that torchrun
starts as a fresh interpreter has Python's defaults instead (SIGINT raises
KeyboardInterrupt, the others end the process), and a script or ``shmtrain train`` must
see the same under both launchers. So this restores those defaults, makes ``os._exit(0)``
end the worker as plain torchrun sees it (:func:`return_on_exit`), then runs
``shmtrain train ARGS`` or the script ``PATH ARGS`` (``sys.argv[1:]``) as ``__main__``.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from typing import Any, NoReturn


def restore_signals() -> None:
    """The signal dispositions of a fresh Python interpreter."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


def _return_slot() -> Any:
    """torchrun's queue for this worker's return value: a local of the frame of
    ``torch.distributed.elastic.multiprocessing.api._wrap``, which runs this file; None
    when no such frame is found (another torch)."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "_wrap" and "ret_val_" in frame.f_locals:
            return frame.f_locals["ret_val_"]
        frame = frame.f_back
    return None


def return_on_exit() -> None:
    """Make ``os._exit(0)`` count as the worker's return. torchrun's agent takes a forked
    worker as finished once its return value has come through this queue (a return, or
    ``sys.exit(0)``, which torch turns into one); a worker that left by ``os._exit(0)``, as
    scripts do to skip gloo's teardown at exit, sent none, and the agent waited for it
    forever. Under plain torchrun the exit status alone counts, so here ``os._exit(0)``
    sends the return value first (a ``SimpleQueue``: written at once), in this process only,
    not in one it forks (``os._exit`` there is that process's own)."""
    slot, real, worker = _return_slot(), os._exit, os.getpid()
    if slot is None:
        return

    def _exit(code: int) -> NoReturn:
        if code == 0 and os.getpid() == worker:
            try:
                slot.put(None)
            except Exception:  # noqa: BLE001 - leaving all the same, as os._exit does
                pass
        real(code)

    os._exit = _exit


def main() -> None:
    restore_signals()
    return_on_exit()
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
