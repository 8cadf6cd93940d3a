"""Stage per-layer tensors between the parameters' device and host buffers (TRL Algorithm 6).

A strategy whose buffers live in host memory (a shared segment laid out by
:class:`shmtrain.fabric.flat.FlatLayout`) reaches them from its parameters' device
through one :class:`HostStaging`; it is the only place that knows about device copies.

IBM TRL, Algorithm 6 (backward with CPU accumulation), on a GPU:

- line 5, ``MemcpyD2HAsync(p_grads[i], grads[i], d2h_stream)``: :meth:`HostStaging.to_host`
  starts the copy of layer ``i``'s gradient into a pinned host buffer (``p_grads``) on a
  device-to-host stream, ordered after the work already queued on the current stream;
- line 6, the callback on that stream: a host thread calls :meth:`HostStaging.host_ready`
  before it reads the buffer;
- line 8, ``MemcpyH2DAsync(grads[u], g_grads[u], h2d_stream)``: :meth:`HostStaging.to_device`
  starts the copy of the reduced result back into ``param.grad`` on a second stream, so
  the two directions overlap each other and backward;
- before the update, :meth:`HostStaging.join` makes the current stream wait for the
  host-to-device stream (a stream wait, the device is never synchronized).

TRL Table 4 reports the two copy phases per layer ("GPU-to-CPU copy", "CPU-to-GPU
copy"); :meth:`HostStaging.host_ready` and :meth:`HostStaging.device_times` return them,
measured with CUDA events on the copy streams.

On the CPU the tensors already are in host memory, so staging passes them through with
no copy: :meth:`HostStaging.to_host` returns the gradient itself and
:meth:`HostStaging.to_device` makes ``param.grad`` a view of the host result.

Nothing CUDA-specific runs at import or on a CPU-only machine: streams, events and
pinned memory are made only for a ``cuda`` device.
"""

from __future__ import annotations

import torch

from shmtrain.fabric.flat import FlatLayout


class HostStaging:
    """Per-layer copies between ``device`` (where the parameters live) and host memory.

    ``copies`` is False on the CPU (pass-through, nothing to copy or time) and True on a
    GPU (asynchronous copies on two streams through pinned per-layer buffers).
    """

    def __init__(self, layout: FlatLayout, device: torch.device | str) -> None:
        self.layout = layout
        self.device = torch.device(device)
        #: whether to_host/to_device really copy (else the host tensors pass through)
        self.copies = self.device.type == "cuda"
        self._h2d_events: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        self._registered: list[int] = []  # host addresses page-locked by register()
        if self.copies:
            # p_grads of Algorithm 6: views of one pinned flat tensor, one per layer
            flat = torch.empty(layout.numel, dtype=layout.dtype, pin_memory=True)
            self.pinned: list[torch.Tensor] = layout.views(flat)
            self._d2h = torch.cuda.Stream(device=self.device)
            self._h2d = torch.cuda.Stream(device=self.device)
        elif self.device.type != "cpu":
            raise ValueError(f"host staging supports cpu and cuda devices, not {self.device.type}")

    def register(self, *host_tensors: torch.Tensor) -> None:
        """Page-lock host tensors the copies read or write (shared segments), so
        ``MemcpyH2DAsync`` from them is asynchronous. Best effort: without it the copies are
        only slower (staged by the driver). No-op on the CPU."""
        if not self.copies:
            return
        try:
            cudart = torch.cuda.cudart()
            for t in host_tensors:
                if int(cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)) == 0:
                    self._registered.append(t.data_ptr())
        except Exception:  # noqa: BLE001 - only slower (staged copies) without it
            pass

    def to_host(self, i: int, grad: torch.Tensor) -> tuple[torch.Tensor, object | None]:
        """Start moving layer ``i``'s ``grad`` to host memory (Algorithm 6, line 5).

        Returns ``(host tensor, handle)``: on the CPU ``(grad, None)`` (no copy); on a GPU
        the pinned buffer of layer ``i`` and a handle for :meth:`host_ready`, which must be
        called before the buffer is read. ``grad`` must not be changed before then by work
        queued outside the current stream.
        """
        if not self.copies:
            return grad, None
        d2h = self._d2h
        d2h.wait_stream(torch.cuda.current_stream(self.device))
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(d2h):
            begin.record(d2h)
            self.pinned[i].copy_(grad, non_blocking=True)
            end.record(d2h)
        grad.record_stream(d2h)  # the caching allocator keeps grad until the copy is done
        return self.pinned[i], (begin, end)

    def host_ready(self, handle: object | None) -> float:
        """Wait until the copy of :meth:`to_host` has landed in host memory (from any
        thread: Algorithm 6's callback); return its time in seconds (TRL Table 4,
        GPU-to-CPU copy), 0.0 for a pass-through (``handle`` None)."""
        if handle is None:
            return 0.0
        begin, end = handle
        end.synchronize()
        return begin.elapsed_time(end) / 1e3

    def to_device(self, i: int, param: torch.Tensor, host_src: torch.Tensor) -> None:
        """Give ``param`` the host result ``host_src`` of layer ``i`` as its gradient
        (Algorithm 6, line 8).

        On the CPU ``param.grad`` becomes ``host_src`` itself (a view of host memory, no
        copy; the caller drops it before anything accumulates into it). On a GPU the copy
        into ``param.grad`` starts on the host-to-device stream; :meth:`join` orders the
        current stream after it, and ``host_src`` must stay unchanged until then.
        """
        if not self.copies:
            param.grad = host_src
            return
        h2d = self._h2d
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(h2d):
            begin.record(h2d)
            param.grad.copy_(host_src, non_blocking=True)
            end.record(h2d)
        self._h2d_events.append((i, begin, end))

    def join(self) -> None:
        """Make the current stream wait for every copy started by :meth:`to_device` (a
        stream wait, never a device-wide synchronization). No-op on the CPU."""
        if self.copies:
            torch.cuda.current_stream(self.device).wait_stream(self._h2d)

    def device_times(self) -> list[tuple[int, float]]:
        """``(layer, seconds)`` of each :meth:`to_device` copy since the last call (TRL
        Table 4, CPU-to-GPU copy), timed by CUDA events; waits for those copies. Empty on
        the CPU."""
        times = []
        for i, begin, end in self._h2d_events:
            end.synchronize()
            times.append((i, begin.elapsed_time(end) / 1e3))
        self._h2d_events.clear()
        return times

    def close(self) -> None:
        """Wait for the copies in flight (the two copy streams only) and undo
        :meth:`register`, before the host segments are unmapped. No-op on the CPU."""
        if not self.copies:
            return
        self._d2h.synchronize()
        self._h2d.synchronize()
        self._h2d_events.clear()
        if self._registered:
            cudart = torch.cuda.cudart()
            for ptr in self._registered:
                cudart.cudaHostUnregister(ptr)
            self._registered.clear()
