"""How a test judges the exit of a script it ran as a user would write it.

torch 2.14 can abort a process at interpreter exit, after the script's last line ran:
``terminate called without an active exception`` (SIGABRT, return code -6). The default
gloo group outlives ``dist.destroy_process_group()`` once an optimizer exists (creating
``torch.optim.SGD`` adds ten references to it that nothing in Python holds), and its
threads are then torn down with the interpreter. Measured on the 2-core VM: 1 run in 60
of a plain two-rank gloo script with no shmtrain in it (init, two SGD steps with an
all_reduce, all_gather, destroy) aborted so; 1 in 60 of the same with
``shmtrain.DataParallel`` (``tests/support/own_group_script.py``). A test of shmtrain
judges what the script printed and an exit that is clean or that abort alone, after the
script's last line (:func:`ended_well`); the scripts whose outputs are files (the
integration recipes, the Lightning script) end with ``os._exit(0)`` once those are written.
The CI run of 2026-12-02 met it in Accelerate's own DDP run of a recipe, no shmtrain in it.
"""

from __future__ import annotations

import subprocess

#: what torch's teardown abort prints, last, on stderr
TEARDOWN_ABORT = "terminate called without an active exception"


def ended_well(result: subprocess.CompletedProcess, last_line: str) -> bool:
    """Whether the script printed ``last_line`` last on stdout and then exited 0, or was
    aborted by torch's teardown after it (SIGABRT with :data:`TEARDOWN_ABORT` as the last
    line of stderr)."""
    if result.stdout.strip().splitlines()[-1:] != [last_line]:
        return False
    if result.returncode == 0:
        return True
    return result.returncode == -6 and result.stderr.strip().splitlines()[-1:] == [TEARDOWN_ABORT]
