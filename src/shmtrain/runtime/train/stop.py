"""Stops that save: Ctrl-C or SIGTERM ends a run with a checkpoint.

**Request.** A worker's first SIGINT or SIGTERM does not interrupt it: the handler
records the signal and sets the host's stop word in the control block
(:meth:`shmtrain.fabric.shm.control.ControlBlock.request_stop`), which every worker of the
host reads once per iteration (one shared-memory load: no system call, no message).
shmtrain's launcher sets the same word when it gets the signal itself (a SIGTERM sent to
the launcher alone). In a job across hosts, the first rank to see a request also sets
the key ``stop`` in the job's store, and every rank polls that key at most every
:data:`POLL_S` seconds, relaying it into its host's word. A second signal to a worker
(more than :data:`DUPLICATE_S` after the first, so the copy torchrun's agent forwards
of the same Ctrl-C does not count), or any signal once its parent (the launcher) is
gone, stops it at once.

**Agreement.** Every rank must stop at the same iteration S for one collective
checkpoint. A rank that first sees the request after iteration ``i`` posts ``seen = i``
in the store (``stop/seen/<rank>``) and trains one more iteration; after it, it waits
until every rank has posted, and S = max(seen) + 1. Why this neither deadlocks nor lets a
rank pass S, for the synchronous strategies (no rank completes iteration k before every
rank has started it): ranks see the request at most one iteration apart (a rank that saw
it after ``i`` started ``i + 1`` after the word was set, so every other rank, before it
can complete ``i + 1``, checks the word and sees it), so every ``seen`` is ``i`` or ``i +
1``, the posts a rank waits for after ``seen + 1`` come from ranks that need nothing
more from it, and S >= seen + 1 for every rank. Asynchronous strategies do not depend on
each other inside an iteration, so their posts arrive too (a slower rank catches up to
S). A rank whose loop ends first (its target, termination alignment) posts its final
count instead, so nobody waits for it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from shmtrain.fabric.shm.control import PeerFailure, PeerTimeout, alive

#: seconds between polls of the store's ``stop`` key, in jobs across hosts only
POLL_S = 0.5
#: a signal this soon after the first is the same request relayed again (torchrun's agent)
DUPLICATE_S = 1.0
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: the code of a stop asked for by ``--early-stop`` (rank 0's model selection), not a signal
EARLY_STOP = 1000


class StopRequest:
    """One rank's view of a stop request and of the agreed stop iteration.

    Installs SIGINT and SIGTERM handlers when created in the main thread (restored by
    :meth:`close`).
    """

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.control = ctx.host.control
        #: the signal that asked for the stop (0: none yet)
        self.signum = 0
        #: raise on a failure in the control block after each iteration (see :meth:`check`)
        self.watch_abort = False
        #: the iteration after which this rank first saw the request
        self.seen: int | None = None
        #: the agreed iteration to stop at (None until every rank has posted)
        self.target: int | None = None
        #: True once this rank's loop ended at the agreed iteration
        self.stopped = False
        self._received: float | None = None  # when this process got its first signal
        self._parent = os.getppid()
        self._last_poll = 0.0
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in _SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)

    def close(self) -> None:
        """Put the previous signal handlers back."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:  # noqa: ARG002
        now = time.monotonic()
        if os.getppid() != self._parent or (
            self._received is not None and now - self._received > DUPLICATE_S
        ) or self._host_torn_down():
            # A second request, or the launcher is gone (its store with it), or torchrun's
            # agent ending this host after a worker died: stop at once (no stop request to
            # the other hosts, which train on when the strategy tolerates a lost host).
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        if self._received is None:
            self._received = now
            self.control.request_stop(signum)

    def _host_torn_down(self) -> bool:
        """Under torchrun, a signal while a worker of this host is dead comes from the
        agent, which ends every worker of a host once one has died."""
        if "TORCHELASTIC_RUN_ID" not in os.environ:
            return False
        me, control = self.ctx.host.local_rank, self.control
        return any(control.pid(r) > 0 and not alive(control.pid(r))
                   for r in range(self.ctx.host.local_world) if r != me)

    def request_early(self) -> None:
        """``--early-stop``: ask every rank to stop as a signal would (agreed iteration, a
        checkpoint), with the code :data:`EARLY_STOP`."""
        self.control.request_stop(EARLY_STOP)

    @property
    def early(self) -> bool:
        """Whether the stop was ``--early-stop``'s (the run counts as finished)."""
        return self.signum == EARLY_STOP

    # -- per iteration ----------------------------------------------------------------------
    def requested(self) -> int:
        """The signal of a pending request (0: none): the host's stop word, and in a job
        across hosts the store's ``stop`` key, polled at most every :data:`POLL_S` s."""
        signum = self.control.stop_requested()
        if signum or self.ctx.num_nodes == 1:
            return signum
        now = time.monotonic()
        if now - self._last_poll >= POLL_S:
            self._last_poll = now
            if self.ctx.store.check(["stop"]):
                self.control.request_stop(int(self.ctx.store.get("stop")))
        return self.control.stop_requested()

    def check(self, iteration: int) -> bool:
        """Call after each iteration: True when this rank stops now (the agreed S).

        With :attr:`watch_abort` (an asynchronous worker whose launcher replaces a dead
        one in place) a failure recorded in the control block raises
        :class:`PeerFailure` here, so the worker joins the recovery."""
        if self.watch_abort:
            failed = self.control.aborted()
            if failed is not None:
                raise PeerFailure(f"local rank {failed[0]} failed (code {failed[1]}); this worker stopped after "
                                  f"iteration {iteration} for its replacement", peer=failed[0])
        if self.target is not None:
            self.stopped = iteration >= self.target
            return self.stopped
        if self.seen is None:
            signum = self.requested()
            if not signum:
                return False
            self.signum, self.seen = signum, iteration
            self.ctx.store.set(f"stop/seen/{self.ctx.rank}", str(iteration))
            if self.ctx.num_nodes > 1:
                self.ctx.store.set("stop", str(signum))
            return False
        self.target = self._agree()
        self.stopped = iteration >= self.target
        return self.stopped

    def finished(self, iteration: int) -> None:
        """Call when this rank's loop has ended: post its count if it has not posted, so
        no rank waits for it."""
        if self.seen is None:
            self.ctx.store.set(f"stop/seen/{self.ctx.rank}", str(iteration))

    def _agree(self) -> int:
        """Wait for every rank's post (or its death); S = max(seen) + 1."""
        ctx = self.ctx
        keys = {r: f"stop/seen/{r}" for r in range(ctx.world_size)}
        local = range(ctx.node_rank * ctx.local_world, (ctx.node_rank + 1) * ctx.local_world)
        deadline = time.monotonic() + ctx.timeout
        while True:
            missing = [r for r, key in keys.items() if not ctx.store.check([key])]
            # a dead worker of this host never posts: do not wait for it
            missing = [r for r in missing if r not in local or alive(self.control.pid(r - local.start))]
            if not missing:
                break
            failed = self.control.aborted()
            if failed is not None:
                raise PeerFailure(f"local rank {failed[0]} failed (code {failed[1]}) while this "
                                  "worker agreed on the iteration to stop at", peer=failed[0])
            if time.monotonic() > deadline:
                raise PeerTimeout(f"ranks {missing} did not answer the stop request within "
                                  f"{ctx.timeout:.0f} s")
            time.sleep(0.005)
        posted = [int(ctx.store.get(key)) for r, key in keys.items() if ctx.store.check([key])]
        return max(posted) + 1

