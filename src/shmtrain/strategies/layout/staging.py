"""Stage tensors between the parameters' device and host buffers (TRL Algorithm 6).

A strategy whose buffers live in host memory (shared segments, the buffer service)
reaches them from its parameters' device through one :class:`HostStaging`; it is the
only place that knows about device copies.

IBM TRL, Algorithm 6 (backward with CPU accumulation), on a GPU:

- line 5, ``MemcpyD2HAsync(p_grads[i], grads[i], d2h_stream)``: :meth:`HostStaging.to_host`
  starts the copy of layer ``i``'s gradient into a host buffer (a pinned ``p_grads``
  buffer, or a registered shared slot given as ``dst``) on a device-to-host stream,
  ordered after the work already queued on the current stream;
- line 6, the callback on that stream: a host thread calls :meth:`Copy.wait` (or
  :meth:`HostStaging.host_ready`) before it reads the buffer, or polls :meth:`Copy.done`;
- line 8, ``MemcpyH2DAsync(grads[u], g_grads[u], h2d_stream)``: :meth:`HostStaging.to_device`
  starts the copy of the reduced result back into ``param.grad`` (or new weights into
  ``param.data``) on a second stream, so the two directions overlap each other and backward;
- before the update (or the next forward), :meth:`HostStaging.join` makes the current
  stream wait for the host-to-device stream (a stream wait: the device is never
  synchronized).

TRL Table 4 reports the two copy phases per layer ("GPU-to-CPU copy", "CPU-to-GPU
copy"); :meth:`Copy.wait` and :meth:`HostStaging.device_times` return them, measured
with CUDA events on the copy streams.

Copies at pinned speed: a copy between the device and host memory runs by DMA, at
the bus's speed and asynchronously, only when the host side is page-locked. The
per-layer buffers (:attr:`HostStaging.pinned`, :meth:`HostStaging.host_buffer`) are pinned
by torch; shared segments are page-locked by :meth:`HostStaging.register`
(``cudaHostRegister``), and :meth:`HostStaging.registered` says whether that worked. A
host side that is neither (a registration the driver refused) goes through a pinned
bounce buffer in both directions, never a pageable copy (which the driver stages
through its own buffer, synchronously, at a fraction of the speed): to the device the
host copies into the bounce buffer and the DMA starts from it; to the host the DMA lands
in the bounce buffer and :meth:`Copy.wait` (or the first :meth:`Copy.done` that sees it
landed) copies it on into the destination (``bounced_bytes`` counts them).

Three modes (``copies``, ``mode``):

- ``cpu``, the default on the CPU: the tensors already are in host memory, so staging
  passes them through with no copy (:meth:`HostStaging.to_host` returns the gradient
  itself; :meth:`HostStaging.to_device` makes ``param.grad`` a view of the host result).
  Strategies keep their zero-copy CPU paths.
- ``cuda``: asynchronous copies on two streams, timed by CUDA events.
- ``copy``: CPU parameters, but every transfer is a real (synchronous) copy between the
  parameters' private tensors and the host buffers, exactly where a GPU would copy. Set
  ``SHMTRAIN_STAGING=copy`` (or :func:`force_copies`) to run a strategy's GPU data flow
  on a CPU-only machine; the tests use it to check each strategy's staged path.

Nothing CUDA-specific runs at import or on a CPU-only machine: streams, events and
pinned memory are made only for a ``cuda`` device.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from shmtrain.strategies.layout.courier import Courier
from shmtrain.strategies.layout.flat import FlatLayout

#: ``SHMTRAIN_STAGING=copy``: real copies on the CPU too (the GPU data flow, ``copy`` mode)
STAGING_ENV = "SHMTRAIN_STAGING"


def staged(device: torch.device | str) -> bool:
    """Whether strategies on ``device`` stage through copies (a GPU, or ``copy`` mode)."""
    kind = torch.device(device).type
    if kind == "cuda":
        return True
    if kind != "cpu":
        raise ValueError(f"host staging supports cpu and cuda devices, not {kind}")
    value = os.environ.get(STAGING_ENV, "")
    if value not in ("", "copy"):
        raise ValueError(f"{STAGING_ENV}={value!r}: the only value is copy (real copies on the CPU, "
                         "the GPU data flow); unset it for the zero-copy CPU path")
    return value == "copy"


@contextmanager
def force_copies() -> Iterator[None]:
    """Within the block, CPU strategies stage through real copies (``copy`` mode)."""
    old = os.environ.get(STAGING_ENV)
    os.environ[STAGING_ENV] = "copy"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(STAGING_ENV, None)
        else:
            os.environ[STAGING_ENV] = old


#: host ranges this process page-locked (address -> bytes): a range is never registered
#: twice (CUDA refuses it, and the failed call's error would surface at the next kernel)
_REGISTERED: dict[int, int] = {}
_CUDART: list[ctypes.CDLL | None] = []


def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch loaded (the same instance, so an error this module
    clears is the one torch's next check would read); None when none is loaded."""
    if not _CUDART:
        lib = None
        try:
            with open("/proc/self/maps") as maps:
                paths = [line.split()[-1] for line in maps if "libcudart.so" in line]
            path = next((p for p in paths if "torchvision" not in p), None)
            lib = ctypes.CDLL(path) if path else None
        except OSError:
            lib = None
        _CUDART.append(lib)
    return _CUDART[0]


def _registered(ptr: int, size: int) -> bool:
    """Whether ``[ptr, ptr + size)`` lies inside one range this process page-locked."""
    return any(p <= ptr and ptr + size <= p + n for p, n in _REGISTERED.items())


class Copy:
    """One transfer started by :class:`HostStaging`: poll it, or wait for it and get its
    time in seconds (CUDA events on a GPU; on the CPU the copy ran when it was started).

    ``then``: host work to do once the device copy has landed, before the data counts as
    there (a copy to host through a pinned bounce buffer: the bounce into the destination);
    run once, by the first :meth:`done` that sees the copy landed or by :meth:`wait`.
    """

    __slots__ = ("_begin", "_end", "_seconds", "_then")

    def __init__(self, seconds: float = 0.0, events: tuple | None = None,
                 then: Callable[[], object] | None = None) -> None:
        self._seconds = seconds
        self._begin, self._end = events if events is not None else (None, None)
        self._then = then

    def done(self) -> bool:
        """True once the data has landed (never blocks on the device)."""
        if self._end is not None and not self._end.query():
            return False
        self._finish()
        return True

    def wait(self) -> float:
        """Block the calling thread until the data has landed; the copy's seconds."""
        if self._end is not None:
            self._end.synchronize()
            self._seconds = self._begin.elapsed_time(self._end) / 1e3
            self._begin = self._end = None
        self._finish()
        return self._seconds

    def _finish(self) -> None:
        if self._then is not None:
            then, self._then = self._then, None
            then()


class HostStaging:
    """Copies between ``device`` (where the parameters live) and host memory.

    ``copies`` is False in ``cpu`` mode (pass-through, nothing to copy or time) and True
    on a GPU and in ``copy`` mode (see the module docstring).
    """

    def __init__(self, layout: FlatLayout, device: torch.device | str) -> None:
        self.layout = layout
        self.device = torch.device(device)
        #: whether to_host/to_device really copy (else the host tensors pass through)
        self.copies = staged(self.device)
        self.cuda = self.device.type == "cuda"
        self._h2d_copies: list[tuple[int, Copy]] = []
        self._registered: list[int] = []  # host addresses page-locked by register()
        #: ``(bytes, page-locked)`` of each host tensor given to :meth:`register` (a GPU only)
        self.registrations: list[tuple[int, bool]] = []
        #: bytes copied through a pinned bounce buffer (their host side was not page-locked)
        self.bounced_bytes = 0
        self._locked: dict[tuple[int, int], bool] = {}  # host storage -> pinned by torch
        self._pinned: list[torch.Tensor] | None = None
        if self.cuda:
            self._d2h = torch.cuda.Stream(device=self.device)
            self._h2d = torch.cuda.Stream(device=self.device)

    @property
    def mode(self) -> str:
        """``cpu`` (pass-through), ``cuda`` (streams) or ``copy`` (synchronous CPU copies)."""
        return "cuda" if self.cuda else ("copy" if self.copies else "cpu")

    @property
    def pinned(self) -> list[torch.Tensor]:
        """``p_grads`` of Algorithm 6: per-layer views of one host flat tensor (pinned on a
        GPU), made at first use."""
        if self._pinned is None:
            flat = torch.empty(self.layout.numel, dtype=self.layout.dtype, pin_memory=self.cuda)
            self._pinned = self.layout.views(flat)
        return self._pinned

    def host_buffer(self, numel: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A host tensor that copies can reach asynchronously (pinned on a GPU)."""
        return torch.empty(numel, dtype=dtype or self.layout.dtype, pin_memory=self.cuda)

    def register(self, *host_tensors: torch.Tensor) -> None:
        """Page-lock host tensors the copies read or write (shared segments), so
        ``MemcpyH2DAsync`` from them is asynchronous. Best effort: without it the copies are
        only slower (staged by the driver). A range that overlaps one this process already
        registered is skipped, and a refused registration's error is cleared (CUDA would
        report it at the next kernel launch). Portable: pinned for every device's context.
        No-op off a GPU."""
        if not self.cuda:
            return
        lib = _cudart()
        if lib is None:
            return
        for t in host_tensors:
            ptr, size = t.data_ptr(), t.numel() * t.element_size()
            if size == 0 or any(ptr < p + n and p < ptr + size for p, n in _REGISTERED.items()):
                self.registrations.append((size, size > 0 and _registered(ptr, size)))
                continue
            with torch.cuda.device(self.device):
                rc = lib.cudaHostRegister(ctypes.c_void_p(ptr), ctypes.c_size_t(size), ctypes.c_uint(1))
                if rc == 0:
                    _REGISTERED[ptr] = size
                    self._registered.append(ptr)
                else:
                    lib.cudaGetLastError()  # clear it: torch's next check would raise it
            self.registrations.append((size, rc == 0))

    def registered(self) -> str:
        """Whether the host tensors given to :meth:`register` are page-locked: ``n/a`` off a
        GPU (nothing to register), ``none given``, else ``K/N`` of them (``N/N``: every one)."""
        if not self.cuda:
            return "n/a"
        if not self.registrations:
            return "none given"
        return f"{sum(ok for _, ok in self.registrations)}/{len(self.registrations)}"

    # -- the copies ---------------------------------------------------------------------
    def _start(self, stream_name: str, dst: torch.Tensor, src: torch.Tensor) -> Copy:
        """Copy ``src`` into ``dst`` on the named stream, ordered after the work queued so
        far on the current stream (synchronously off a GPU)."""
        if not self.cuda:
            start = time.perf_counter()
            with torch.no_grad():
                dst.copy_(src)
            return Copy(time.perf_counter() - start)
        d2h = stream_name == "d2h"
        stream = self._d2h if d2h else self._h2d
        host = dst if d2h else src
        then = None
        if not host.is_cuda and not self._page_locked(host):  # DMA needs page-locked memory:
            bounce = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)  # through a pinned one
            self.bounced_bytes += host.numel() * host.element_size()
            if d2h:
                dst, then = bounce, (lambda out=dst, pinned=bounce: out.copy_(pinned))
            else:
                bounce.copy_(src)  # (freed: the host allocator keeps it until the copy is done)
                src = bounce
        stream.wait_stream(torch.cuda.current_stream(self.device))
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream), torch.no_grad():
            begin.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        for t in (dst, src):  # the caching allocator keeps device tensors until the copy is done
            if t.is_cuda:
                t.record_stream(stream)
        return Copy(events=(begin, end), then=then)

    def _page_locked(self, host: torch.Tensor) -> bool:
        """Whether a copy can reach ``host`` by DMA: inside a range :meth:`register` locked,
        or pinned by torch (asked once per storage)."""
        if _registered(host.data_ptr(), host.numel() * host.element_size()):
            return True
        storage = host.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in self._locked:
            self._locked[key] = host.is_pinned()
        return self._locked[key]

    def to_host(self, i: int, grad: torch.Tensor, dst: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, Copy | None]:
        """Start moving layer ``i``'s ``grad`` to host memory (Algorithm 6, line 5).

        Returns ``(host tensor, copy)``: pass-through ``(grad, None)`` (no copy); else
        ``dst`` (default: the pinned buffer of layer ``i``) and the :class:`Copy`, to be
        waited for before the host tensor is read. ``grad`` must not be changed before then
        by work queued outside the current stream.
        """
        if not self.copies:
            return grad, None
        host = self.pinned[i] if dst is None else dst
        return host, self._start("d2h", host, grad)

    def host_ready(self, handle: Copy | None) -> float:
        """Wait until the copy of :meth:`to_host` has landed in host memory (from any
        thread: Algorithm 6's callback); return its time in seconds (TRL Table 4,
        GPU-to-CPU copy), 0.0 for a pass-through (``handle`` None)."""
        return 0.0 if handle is None else handle.wait()

    def to_device(self, i: int, param: torch.Tensor, host_src: torch.Tensor, *, data: bool = False) -> None:
        """Give ``param`` the host result ``host_src`` of layer ``i`` as its gradient
        (Algorithm 6, line 8), or as its weights with ``data``.

        Pass-through: ``param.grad`` (or ``param.data``) becomes ``host_src`` itself (a view
        of host memory, no copy; the caller drops a gradient before anything accumulates
        into it). Copying: the copy into ``param.grad`` (made if missing) or
        ``param.data`` starts on the host-to-device stream; :meth:`join` orders the
        current stream after it, and ``host_src`` must stay unchanged until then.
        """
        if not self.copies:
            if data:
                param.data = host_src
            else:
                param.grad = host_src
            return
        if data:
            target = param.data
        else:
            if param.grad is None:
                param.grad = torch.empty_like(param)
            target = param.grad
        self._h2d_copies.append((i, self._start("h2d", target, host_src)))

    def courier(self, name: str) -> Courier:
        """A host thread for the work that follows these copies (:class:`Courier`): a staged
        hook starts its copy and submits the rest there, so it never waits."""
        return Courier(self.device, name)

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Copy:
        """Start a copy of device tensor ``src`` into host tensor ``dst`` (after the work
        queued so far on the current stream); wait for the :class:`Copy` before reading."""
        return self._start("d2h", dst, src)

    # -- every layer at once (the strategies that exchange at one point of the step) ------
    def to_host_all(self, host_views: list[torch.Tensor], *, grads: bool) -> float:
        """Copy every parameter's gradient (or, ``grads=False``, its weights) into its host
        view and wait for the copies; a missing gradient (a parameter backward did not
        reach) becomes zeros. Returns the copies' seconds (``copy_to_host``)."""
        copies = []
        for i, p in enumerate(self.layout.params):
            src = p.grad if grads else p.data
            if src is None:
                host_views[i].zero_()
            else:
                copies.append(self.to_host(i, src, dst=host_views[i])[1])
        return sum(copy.wait() for copy in copies)

    def to_device_all(self, host_views: list[torch.Tensor], *, data: bool = False) -> list[Copy]:
        """:meth:`to_device` for every parameter from its host view, then :meth:`join`;
        the copies, not waited for (for :meth:`shmtrain.timing.PhaseTimer.add_copies`)."""
        for i, p in enumerate(self.layout.params):
            self.to_device(i, p, host_views[i], data=data)
        self.join()
        return self.take_copies()

    def join(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make the current stream (or ``stream``: another thread's) wait for every copy
        started towards the device so far (a stream wait, never a device-wide
        synchronization). No-op off a GPU."""
        if self.cuda:
            (stream or torch.cuda.current_stream(self.device)).wait_stream(self._h2d)

    def take_copies(self) -> list[Copy]:
        """The :meth:`to_device` copies since the last call, not waited for (for
        :meth:`shmtrain.timing.PhaseTimer.add_copies`: timed when the iteration closes)."""
        copies = [copy for _, copy in self._h2d_copies]
        self._h2d_copies.clear()
        return copies

    def device_times(self) -> list[tuple[int, float]]:
        """``(layer, seconds)`` of each :meth:`to_device` copy since the last call (TRL
        Table 4, CPU-to-GPU copy; CUDA events on a GPU); waits for those copies. Empty in
        pass-through mode."""
        times = [(i, copy.wait()) for i, copy in self._h2d_copies]
        self._h2d_copies.clear()
        return times

    def close(self) -> None:
        """Wait for the copies in flight (the two copy streams only) and undo
        :meth:`register`, before the host segments are unmapped. No-op off a GPU."""
        self._h2d_copies.clear()
        if not self.cuda:
            return
        self._d2h.synchronize()
        self._h2d.synchronize()
        lib = _cudart()
        for ptr in self._registered:
            _REGISTERED.pop(ptr, None)
            if lib is not None and lib.cudaHostUnregister(ctypes.c_void_p(ptr)) != 0:
                lib.cudaGetLastError()
        self._registered.clear()
