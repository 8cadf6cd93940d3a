"""The worker's side of ``shmtrain run`` (``runtime/launch/script_launch.py``): what a script's
worker holds before the script joins the job itself (:class:`ScriptContext`), and the
script run as ``__main__`` (:func:`run_script`)."""

from __future__ import annotations

import os
import runpy
import sys
from dataclasses import dataclass
from typing import Any

from shmtrain.fabric.shm.control import ControlBlock
from shmtrain.fabric.shm.segment import SharedSegment


@dataclass
class ScriptContext:
    """What a script's worker holds of the job before the script joins it itself: the
    host's control block (a failure marked there wakes peers waiting in shared memory);
    the payload, results and the one-line error report are files of the launcher's
    private folder (``runtime/launch/job_dir.py``)."""

    rank: int
    local_rank: int
    segment: SharedSegment
    control: ControlBlock

    @classmethod
    def from_env(cls, timeout: float) -> ScriptContext:  # noqa: ARG003 - the script's own waits
        rank = int(os.environ["RANK"])
        local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
        # a copy of the descriptor: DataParallel's context takes the inherited one
        segment = SharedSegment(os.environ["SHMTRAIN_CONTROL"], ControlBlock.nbytes(local_world), create=False,
                                fd=os.dup(int(os.environ["SHMTRAIN_CONTROL_FD"])))
        control = ControlBlock(segment, local_world, init=False)
        control.set_pid(local_rank, os.getpid())
        return cls(rank, local_rank, segment, control)

    def fail(self, code: int = 1) -> None:
        """Tell the host's peers this worker failed."""
        self.control.abort(self.local_rank, code)

    def shutdown(self) -> None:
        """Nothing to leave: the script's own process group is the script's."""

    def close(self) -> None:
        self.segment.close()


def run_script(ctx: ScriptContext, payload: dict[str, Any]) -> None:  # noqa: ARG001 - a launch target
    """Run the script (or ``-m`` module) as ``__main__``, as ``python`` would; ``sys.exit(0)``
    is a normal end, any other status the worker's exit status."""
    os.setsid()  # its own session (torchrun's workers too): Ctrl-C comes once, from the launcher
    args = payload["args"]
    try:
        if payload["module"]:
            sys.argv = [payload["module"], *args]  # runpy puts the module's file in argv[0]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(payload["module"], run_name="__main__", alter_sys=True)
        else:
            script = payload["script"]
            sys.argv = [script, *args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or exc.code == 0:
            return
        if isinstance(exc.code, int):
            raise
        print(exc.code, file=sys.stderr)  # sys.exit("message"): printed, status 1
        raise SystemExit(1) from None
