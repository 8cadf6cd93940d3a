"""The launcher's side of replacing a dead worker in place (one host).

When a worker dies without a report of its own (``kill -9``, the OOM killer: an error it
raised would meet the same cause again), the survivors do not exit: they stop where the
death found them, each posts the steps it completed (``recover/<rank>`` in the
generation's keys of the job's store) and waits. :class:`Replacer` then

1. makes a fresh control block for the next generation (the old one stays aborted, so
   a helper thread of a survivor still winding down can only touch that one);
2. posts the plan (``recover/plan``: the generation, every survivor's steps, from
   which the survivors choose the donor whose state the replacement starts from
   (``runtime/run/recovery.py``), and where the new control block is open) and forks
   the replacement from the warm zygote, with the dead rank's number, the new
   generation and the donor's state file in its environment.

The survivors and the replacement then form the job again under the new generation's
keys (``g<N>/`` of the store), as at the start. ``budget`` is ``--max-restarts``: each
replacement spends one; when none is left, or the death is not one a replacement
cures, the launch fails as before (and ``shmtrain train`` restarts every worker while
restarts are left). Torchft's replica groups and FT-HSDP make the failed replica the
unit of failure the same way; here the unit is one worker of the host.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shmtrain.fabric.job.context import GENERATION_ENV, generation_store
from shmtrain.fabric.shm.control import DIED, ControlBlock
from shmtrain.fabric.shm.segment import SharedSegment

#: environment of a replacement: the donor's state file it starts from
STATE_FILE_ENV = "SHMTRAIN_RECOVER_STATE"

#: environment of every worker of a launch that replaces in place: the launcher's pid
#: (the process whose descriptors a survivor opens to reach the new control block)
LAUNCHER_ENV = "SHMTRAIN_LAUNCHER_PID"


@dataclass
class Budget:
    """Replacements left to a run (``--max-restarts``) and those spent."""

    left: int
    used: int = 0
    #: seconds from each death seen to the replacement's fork
    seconds: list[float] = field(default_factory=list)


def state_file(job_dir: str, generation: int) -> str:
    """The donor's state for ``generation`` in the job's private folder."""
    return os.path.join(job_dir, f"recover-g{generation}.pt")


class Replacer:
    """Replace a dead worker of a local launch in place (see the module docstring).

    ``job`` is the launch's set-up (its store, control block, environment, prefix);
    ``start`` forks worker ``rank`` with an environment; ``children`` are the workers.
    """

    def __init__(self, job: Any, budget: Budget, start: Callable[[int, dict[str, str]], Any],
                 children: list[Any], timeout: float) -> None:
        self.job, self.budget, self.start, self.children = job, budget, start, children
        self.timeout = timeout
        self.generation = 0
        #: every generation's control block (the old ones stay mapped until the launch ends)
        self.blocks: list[SharedSegment] = []
        #: the plan of the last replacement
        self.last: dict[str, Any] = {}

    def curable(self, rank: int, code: int) -> bool:
        """Whether the death of ``rank`` (exit ``code``) is one a replacement cures: a
        budget left, and no error the worker reported itself (that cause would come back)."""
        zygote = getattr(self.children[rank], "zygote", None)
        if zygote is not None and not zygote.alive():  # it took every worker with it
            return False
        # a worker that raised writes its report before it exits: wait for it unless a signal ended it
        return self.budget.left > 0 and code != 0 and not self.job.dir.error(rank, wait=0.0 if code < 0 else 0.2)

    def replace(self, rank: int, code: int, control: ControlBlock) -> ControlBlock | None:
        """Replace ``rank``; the new generation's control block, or None when the
        survivors could not all report (the launch then fails as before)."""
        seen = time.monotonic()
        control.abort(rank, DIED if code < 0 else code)  # wakes every survivor's wait
        store = generation_store(self.job.store, self.generation)
        survivors = [r for r in range(len(self.children)) if r != rank]
        steps = self._reports(store, survivors)
        if steps is None:
            self.give_up()
            return None
        generation = self.generation + 1
        segment = SharedSegment(f"{self.job.prefix}-h0-control-g{generation}",
                                ControlBlock.nbytes(len(self.children)), create=True)
        block = ControlBlock(segment, len(self.children), init=True)
        segment.unlink()  # the survivors open it through this process's descriptor
        self.blocks.append(segment)
        next_store = generation_store(self.job.store, generation)
        next_store.set("run_id", self.job.store.get("run_id").decode())
        path = state_file(str(self.job.dir.path), generation)
        # the survivors choose the donor from every report, by their blocks of replicas
        self.last = {"generation": generation, "reports": {str(r): n for r, n in steps.items()}, "replaced": rank,
                     "control": segment.name, "pid": os.getpid(), "fd": segment.fd, "state": path}
        store.set("recover/plan", json.dumps(self.last))
        env = dict(self.job.env, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank),
                   SHMTRAIN_CONTROL=segment.name, SHMTRAIN_CONTROL_FD=str(segment.fd),
                   **{GENERATION_ENV: str(generation), STATE_FILE_ENV: path})
        self.children[rank] = self.start(rank, env)
        block.set_pid(rank, self.children[rank].pid)  # its death during set-up is seen by every wait
        self.generation = generation
        self.budget.left -= 1
        self.budget.used += 1
        self.budget.seconds.append(time.monotonic() - seen)
        return block

    def give_up(self) -> None:
        """Tell the survivors of this generation that no replacement comes: they raise
        the failure they met at once."""
        generation_store(self.job.store, self.generation).set("recover/plan", json.dumps({"fail": True}))

    def _reports(self, store: Any, survivors: list[int]) -> dict[int, int] | None:
        """Each survivor's completed steps, once all have posted; None when one died
        too, or one did not post within the timeout."""
        deadline = time.monotonic() + self.timeout
        steps: dict[int, int] = {}
        while len(steps) < len(survivors):
            for r in survivors:
                if r not in steps and store.check([f"recover/{r}"]):
                    steps[r] = int(store.get(f"recover/{r}"))
            if any(self.children[r].poll() is not None for r in survivors) or time.monotonic() > deadline:
                return None
            time.sleep(0.01)
        return steps

    def close(self) -> None:
        for segment in self.blocks:
            segment.close()
