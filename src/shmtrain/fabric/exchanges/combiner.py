"""Per-layer sums across hosts by the hosts' leaders, while backward goes on.

CaffeGPI (Fig. 4) and IBM TRL (Algorithms 6-7) reduce each layer's gradient as backward
produces it: CaffeGPI through a binomial tree of one-sided writes, TRL through host
threads that accumulate under a per-layer critical section. Inside a host shmtrain does
exactly that through shared memory. Across hosts the tree's upper edges are the hosts'
leaders (local rank 0): once a host holds its own sum of a layer, its leader sums that
layer with the other hosts' leaders and every leader then holds the job's sum.

:class:`HostCombiner` is that cross-host edge: one thread on each leader that, round
after round, takes the layers in one fixed order (the same on every host, so the
collectives pair up), waits until this host's sum of the layer is complete, sums it in
place with the other leaders (``all_reduce`` on a gloo group of the leaders alone, so
it never interleaves with the main thread's collectives), and publishes the result to
the host. The thread sleeps in the wait and inside gloo (which releases the GIL), so it
takes no core from backward while it has nothing to do.

Why an allreduce among leaders rather than a tree reduce to one root followed by a
broadcast of the new weights: the link between hosts is the slowest one a layer
crosses; with every leader holding the sum, each applies the same update to its host
(the same optimizer on the same numbers gives the same weights), and the layer crosses
the link once instead of twice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from shmtrain.fabric.job.hierarchy import Hierarchy
from shmtrain.fabric.shm.control import PeerFailure, first_line


class Stopped(Exception):
    """Raised inside the combiner's waits once :meth:`HostCombiner.close` was called."""


#: ``ready(layer, round, check)``: block until this host's sum of ``layer`` for
#: ``round`` is complete, calling ``check()`` (which raises :class:`Stopped`) while waiting
ReadyFn = Callable[[int, int, Callable[[], None]], None]


class HostCombiner:
    """Sum one tensor per layer across the hosts' leaders, layer by layer, on a thread.

    Args:
        leaders: this leader's side of the hosts' hierarchy, on a leaders' gloo group of
            the combiner's own (one rank per host).
        order: the layers in the order every leader sums them (the same on every host).
        tensor: ``tensor(layer, round)``, the host's sum of ``layer`` in ``round``,
            summed in place (contiguous).
        done: ``done(layer, round)``, called on the thread once the job's sum is in place.
        ready: how the thread learns that a layer is ready; None: :meth:`submit`.
        name: the thread's name.

    Rounds are numbered from 1, like the strategies' exchanges (``steps + 1``).
    """

    def __init__(
        self,
        leaders: Hierarchy,
        order: Sequence[int],
        tensor: Callable[[int, int], torch.Tensor],
        done: Callable[[int, int], None],
        *,
        ready: ReadyFn | None = None,
        name: str = "shmtrain-host-combiner",
    ) -> None:
        self.hierarchy = leaders
        self.order = list(order)
        self._tensor = tensor
        self._done = done
        self._ready = ready or self._wait_submitted
        self._cond = threading.Condition()
        self._submitted: set[tuple[int, int]] = set()
        self._stop = False
        #: the exception that ended the thread (re-raised by :meth:`check`)
        self.error: BaseException | None = None
        #: where the thread is, for error messages: (round, layer) being waited for or summed
        self.at: tuple[int, int] = (1, self.order[0] if self.order else -1)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- the main thread's side ------------------------------------------------------
    def submit(self, layer: int, round_: int) -> None:
        """This host's sum of ``layer`` for ``round_`` is complete (default ``ready``)."""
        with self._cond:
            self._submitted.add((round_, layer))
            self._cond.notify()

    def check(self) -> None:
        """Re-raise the thread's failure on the caller's thread (e.g. a host lost)."""
        if self.error is not None:
            raise self.error

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread at its next wait (it is between rounds at the end of a run)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- the thread -----------------------------------------------------------------------
    def _check_stop(self) -> None:
        if self._stop:
            raise Stopped

    def _wait_submitted(self, layer: int, round_: int, check: Callable[[], None]) -> None:
        key = (round_, layer)
        with self._cond:
            while key not in self._submitted:
                check()
                self._cond.wait(0.5)
            self._submitted.discard(key)

    def _run(self) -> None:
        round_ = 1
        try:
            while True:
                for layer in self.order:
                    self.at = (round_, layer)
                    self._ready(layer, round_, self._check_stop)
                    self.hierarchy.allreduce(self._tensor(layer, round_))
                    self._done(layer, round_)
                round_ += 1
        except Stopped:
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread by check()
            self.error = PeerFailure(
                f"summing layer {self.at[1]} (exchange {self.at[0]}) with the other hosts' leaders "
                f"failed: {first_line(exc)}; a host was lost or stalled (see its log)")
            self.error.__cause__ = exc
