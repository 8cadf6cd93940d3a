"""The host side of staged hooks: a thread that waits for copies and does the host work.

On a GPU, a gradient hook runs while the device still computes the rest of backward; any
wait or host-side loop there holds the thread that launches backward's kernels and the
device's queue drains (CaffeGPI's turns and the buckets' host reductions in the hooks made
backward 2-3x longer on an H100). TRL Algorithm 6 keeps the hook to stream-ordered work:
line 5 starts ``MemcpyD2HAsync`` and line 6 leaves the rest to "a callback on that stream",
a host thread. :class:`Courier` is that thread for the staged strategies (``ssgd
--overlap``, ``gpi``; ``cpu_acc`` has its own accumulator thread, Algorithm 7): a hook
starts the copy (:meth:`shmtrain.strategies.layout.staging.HostStaging.to_host`) and :meth:`submit`\\ s
the work to do once it has landed; the courier waits for the copy (a CUDA event) and does
it, in submission order. After backward the training thread :meth:`drain`\\ s it, so the
strategy's state is its own again.

Only staged strategies (a GPU, or ``SHMTRAIN_STAGING=copy``) use it: on the zero-copy
CPU path a helper thread would take time slices from the compute threads (one per core)
and the hooks keep their work (docs/architecture.md, process model).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch


class Courier:
    """One host thread running submitted calls in order (see the module docstring).

    A call that raises stops the courier: later calls are dropped and :meth:`drain`
    (or the next :meth:`submit`) raises the error on the training thread.
    """

    def __init__(self, device: torch.device, name: str) -> None:
        self.device = device
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def ident(self) -> int | None:
        """The courier thread's identifier (tests check where work ran)."""
        return self._thread.ident

    def submit(self, call: Callable[..., Any], *args: Any) -> None:
        """Run ``call(*args)`` on the courier after the calls submitted before (never blocks)."""
        self._raise()
        with self._idle:
            self._pending += 1
        self._queue.put((call, args))

    def drain(self, timeout: float) -> float:
        """Wait until every submitted call has run; raise the first error of one. Returns
        the seconds waited (what backward left to the courier)."""
        start = time.perf_counter()
        with self._idle:
            if not self._idle.wait_for(lambda: self._pending == 0, timeout=timeout):
                raise TimeoutError(f"{self._thread.name}: {self._pending} staged call(s) not done after "
                                   f"{timeout:.0f} s (a copy that never landed?)")
        self._raise()
        return time.perf_counter() - start

    def close(self) -> None:
        """Stop the thread once the calls queued so far have run (errors are not raised)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=60)

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        if self.device.type == "cuda":  # event waits and launches on the model's GPU
            torch.cuda.set_device(self.device)
        while True:
            item = self._queue.get()
            if item is None:
                return
            call, args = item
            try:
                if self._error is None:
                    call(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread by drain
                self._error = exc
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
