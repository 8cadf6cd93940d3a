"""The ``shm`` backend's collectives beyond the sum: c10d's methods, each through the host's
shared memory (:class:`~shmtrain.backend.host_ops.HostOps`) where the group is one host and
its tensors are CPU tensors of a dtype gloo has, else gloo's.

Through shared memory, inside one host: ``allreduce`` and ``allreduce_coalesced`` of MAX,
MIN, PRODUCT (and BAND, BOR, BXOR of integers), ``broadcast``, ``allgather``,
``_allgather_base`` (``all_gather_into_tensor``), their coalesced forms, ``reduce``,
``gather``, ``scatter``, ``reduce_scatter``, ``_reduce_scatter_base``
(``reduce_scatter_tensor``), its coalesced form, ``alltoall`` and ``all_to_all_single``
(uneven splits) and ``barrier``. Across hosts these are gloo's (the sum and the average are
hierarchical, :mod:`shmtrain.backend.reducer`); so are sparse tensors (inside a host their SUM is
:mod:`shmtrain.backend.sparse`'s), PREMUL_SUM,
``monitored_barrier`` and send/recv.

Each call's counts: :attr:`Collectives.through_shm` and :attr:`Collectives.through_gloo`
(calls per op, this process, every group), so a test or a user sees that nothing fell back.
A strided tensor is moved as a contiguous copy, copied back; a tensor that requires grad is
moved on its ``.detach()``\\ ed data, as gloo does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Work

from shmtrain.backend.reduce_ops import DTYPES, INTEGERS, MOVED, reduction


def _movable(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.layout == torch.strided and tensor.dtype in MOVED


def _reducible(tensor: torch.Tensor, op: str | None) -> bool:
    """A tensor whose reduction ``op`` goes through shared memory: a gloo dtype the op is
    defined on (bitwise ops: integers only)."""
    if op is None or not _movable(tensor) or tensor.dtype not in DTYPES:
        return False
    return tensor.dtype in INTEGERS or not op.startswith("B")


class _Staged:
    """Contiguous buffers of a call's tensors (the tensors themselves where contiguous);
    :meth:`back` copies the written ones back into strided originals."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.originals = [t.detach() for t in tensors]
        self.buffers = [t if t.is_contiguous() else t.contiguous() for t in self.originals]

    def back(self) -> None:
        for original, buffer in zip(self.originals, self.buffers, strict=True):
            if buffer is not original:
                original.copy_(buffer)


class Collectives:
    """The collectives of :class:`~shmtrain.backend.group.ShmBackend` beyond the sum (module
    docstring). Needs ``reducer`` (a :class:`~shmtrain.backend.reducer.HostReducer`),
    ``gloo`` and ``_gloo(name, *args)`` of the backend."""

    #: calls per op that went through shared memory (this process, every group)
    through_shm: Counter = Counter()
    #: calls per op handed to gloo
    through_gloo: Counter = Counter()

    reducer: Any
    gloo: Any
    _gloo: Callable[..., Work]
    profile_name: str

    def _record(self, name: str, tensors: Sequence[torch.Tensor]) -> Any:
        """A profiler record of the call, named as gloo's (``gloo:all_gather``, with the
        tensors upstream's profiling tests expect), while a profiler records."""
        if not torch.autograd._profiler_enabled():
            return None
        return torch._C._autograd._record_function_with_args_enter(f"{self.profile_name}:{name}", *tensors)

    def _in_host(self, tensors: Sequence[torch.Tensor]) -> bool:
        return self.reducer.hosts == 1 and all(_movable(t) for t in tensors)

    def _shm(self, op: str, tensors: list[torch.Tensor], run: Callable[[], None], profile: Any = None,
             sent: Sequence[torch.Tensor] = ()) -> Work:
        """Submit ``run`` (the call, on the reducer's thread or this one) with a Work of
        ``tensors``; ``profile``: its profiler record (:meth:`_record`); ``sent``: what this
        rank sends (a call small enough to travel with its header runs on this thread)."""
        def counted() -> None:
            run()
            Collectives.through_shm[op] += 1

        small = sum(t.numel() * t.element_size() for t in sent) <= self.reducer.carried
        return self.reducer.submit_call(counted, tensors, profile, small=small)

    def _fallback(self, op: str, name: str, *args: Any) -> Work:
        Collectives.through_gloo[op] += 1
        return self._gloo(name, *args)

    # -- reductions other than SUM and AVG of all_reduce -------------------------------
    def _reduce_in_host(self, tensors: list[torch.Tensor], op: str, profile: Any,
                        name: str = "all_reduce") -> Work:
        """``allreduce`` (one tensor) or ``allreduce_coalesced`` of a reduction other than
        the sum's pipeline (MAX, MIN, PRODUCT, bitwise), each tensor on its own."""
        staged = _Staged(tensors)
        reducer = self.reducer

        def run() -> None:
            for buffer in staged.buffers:
                begin = partial(reducer.begin, "all_reduce", buffer.numel(), buffer.dtype, op, len(tensors))
                reducer.ops.reduce_scatter(buffer, [buffer], op, begin, same=True)
            staged.back()

        return self._shm(name, tensors, run, profile, tensors)

    def _other_reduction(self, tensors: list[torch.Tensor], op: str | None) -> bool:
        """Whether the reduction ``op`` of ``tensors`` goes through :meth:`_reduce_in_host`."""
        return (op is not None and self.reducer.hosts == 1 and bool(tensors)
                and all(_reducible(t, op) for t in tensors))

    # -- broadcast, gather, scatter, reduce ---------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        opts = opts or dist.BroadcastOptions()
        if len(tensors) != 1 or not self._in_host(tensors):
            return self._fallback("broadcast", "broadcast", tensors, opts)
        staged, root, reducer = _Staged(tensors), opts.rootRank, self.reducer

        def run() -> None:
            buffer = staged.buffers[0]
            begin = partial(reducer.begin, "broadcast", buffer.numel(), buffer.dtype, "broadcast", root)
            reducer.ops.broadcast(buffer, root, begin)
            staged.back()

        return self._shm("broadcast", tensors, run, self._record("broadcast", tensors), tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        opts = opts or dist.ReduceOptions()
        op = reduction(opts.reduceOp)
        if len(tensors) != 1 or self.reducer.hosts != 1 or not _reducible(tensors[0], op):
            return self._fallback("reduce", "reduce", tensors, opts)
        staged, root, reducer = _Staged(tensors), opts.rootRank, self.reducer

        def run() -> None:
            buffer = staged.buffers[0]
            begin = partial(reducer.begin, "reduce", buffer.numel(), buffer.dtype, f"reduce {op}", root)
            reducer.ops.reduce(buffer, root, op, begin)
            staged.back()

        return self._shm("reduce", tensors, run, self._record("reduce", tensors), tensors)

    def gather(self, outputs: Any, inputs: Any, opts: Any = None) -> Work:
        opts = opts or dist.GatherOptions()
        root, reducer = opts.rootRank, self.reducer
        mine = reducer.host.local_rank == root
        receives = list(outputs[0]) if mine and outputs else []
        tensors = [*inputs, *receives]
        ok = len(inputs) == 1 and self._in_host(tensors) and (not mine or (
            len(receives) == reducer.local_world and all(r.dtype == inputs[0].dtype and
                                                         r.numel() == inputs[0].numel() for r in receives)))
        if not ok:
            return self._fallback("gather", "gather", outputs, inputs, opts)
        source, staged = _Staged(inputs), _Staged(receives)

        def run() -> None:
            buffer = source.buffers[0]
            begin = partial(reducer.begin, "gather", buffer.numel(), buffer.dtype, "gather", root)
            reducer.ops.gather(staged.buffers if mine else None, buffer, root, begin)
            staged.back()

        return self._shm("gather", receives or list(inputs), run, self._record("gather", inputs), inputs)

    def scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> Work:
        opts = opts or dist.ScatterOptions()
        root, reducer = opts.rootRank, self.reducer
        mine = reducer.host.local_rank == root
        sends = list(inputs[0]) if mine and inputs else []
        tensors = [*outputs, *sends]
        ok = len(outputs) == 1 and self._in_host(tensors) and (not mine or (
            len(sends) == reducer.local_world and all(s.dtype == outputs[0].dtype and
                                                      s.numel() == outputs[0].numel() for s in sends)))
        if not ok:
            return self._fallback("scatter", "scatter", outputs, inputs, opts)
        staged, source = _Staged(outputs), _Staged(sends)

        def run() -> None:
            buffer = staged.buffers[0]
            begin = partial(reducer.begin, "scatter", buffer.numel(), buffer.dtype, "scatter", root)
            reducer.ops.scatter(buffer, source.buffers if mine else None, root, begin)
            staged.back()

        return self._shm("scatter", list(outputs), run, self._record("scatter", sends or outputs), sends or outputs)

    # -- all_gather ---------------------------------------------------------------------
    def _gather_all(self, op: str, pairs: list[tuple[list[torch.Tensor] | torch.Tensor, torch.Tensor]],
                    result: list[torch.Tensor] | None = None, recorded: str = "all_gather") -> Work | None:
        """All-gather each ``(outputs, input)`` pair in one call (``outputs``: ``L`` tensors,
        or one contiguous tensor of ``L`` pieces; ``result``: the Work's tensors, default
        every output); None where a pair cannot go through shared memory (the caller hands
        the call to gloo)."""
        L = self.reducer.local_world
        for outs, inp in pairs:
            if isinstance(outs, torch.Tensor):
                if not self._in_host([inp, outs]):
                    return None
            elif (len(outs) != L or not self._in_host([inp, *outs])
                    or any(o.dtype != inp.dtype or o.numel() != inp.numel() for o in outs)):
                return None
        staged = [(outs if isinstance(outs, torch.Tensor) else _Staged(outs), _Staged([inp])) for outs, inp in pairs]
        reducer = self.reducer

        def run() -> None:
            for outs, inp in staged:
                buffer = inp.buffers[0]
                begin = partial(reducer.begin, op, buffer.numel(), buffer.dtype, "all_gather", len(staged))
                if isinstance(outs, torch.Tensor):
                    reducer.ops.all_gather(outs, buffer, begin)
                else:
                    reducer.ops.all_gather(outs.buffers, buffer, begin)
                    outs.back()

        tensors = result if result is not None else [o for outs, _ in pairs for o in outs]
        sent = [inp for _, inp in pairs]
        return self._shm(op, tensors, run, self._record(recorded, sent), sent)

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> Work:
        work = None
        if len(inputs) == 1 and len(outputs) == 1:
            work = self._gather_all("all_gather", [(list(outputs[0]), inputs[0])])
        return work or self._fallback("all_gather", "allgather", outputs, inputs, opts or dist.AllgatherOptions())

    def _into_pairs(self, output: torch.Tensor, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``all_gather_into_tensor``'s output, ``L`` pieces of the input's size (a
        contiguous output only, of a tensor that is not empty; None otherwise)."""
        L = self.reducer.local_world
        if (not output.is_contiguous() or output.numel() != L * input.numel() or output.dtype != input.dtype
                or not input.numel()):
            return None
        return output.detach(), input

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:
        pair = self._into_pairs(output, input)
        work = None
        if pair:
            work = self._gather_all("all_gather_into_tensor", [pair], [output], "all_gather_into_tensor")
        return work or self._fallback("all_gather_into_tensor", "_allgather_base", output, input,
                                      opts or dist.AllgatherOptions())

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:
        return self._allgather_base(output, input, opts)

    def allgather_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Work:
        work = None  # outputs[r][k]: rank r's input k
        if inputs and len(outputs) == self.reducer.local_world and all(len(o) == len(inputs) for o in outputs):
            pairs = [([o[k] for o in outputs], inp) for k, inp in enumerate(inputs)]
            work = self._gather_all("all_gather_coalesced", pairs)
        return work or self._fallback("all_gather_coalesced", "allgather_coalesced", outputs, inputs,
                                      opts or dist.AllgatherOptions())

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Work:
        pairs = []
        if len(outputs) == len(inputs):
            pairs = [self._into_pairs(o, i) for o, i in zip(outputs, inputs, strict=True)]
        work = None
        if pairs and all(pairs):
            work = self._gather_all("all_gather_into_tensor_coalesced", pairs, list(outputs),
                                    "all_gather_into_tensor_coalesced")
        return work or self._fallback("all_gather_into_tensor_coalesced", "all_gather_single_coalesced", outputs,
                                      inputs, opts or dist.AllgatherOptions())

    # -- reduce_scatter -----------------------------------------------------------------
    def _scatter_reduced(self, op_name: str, pairs: list[tuple[torch.Tensor, list[torch.Tensor]]],
                         op: str | None, recorded: str = "reduce_scatter") -> Work | None:
        L = self.reducer.local_world
        for out, ins in pairs:
            if (len(ins) != L or self.reducer.hosts != 1 or not all(_reducible(t, op) for t in [out, *ins])
                    or any(t.dtype != out.dtype or t.numel() != out.numel() for t in ins)):
                return None
        staged = [(_Staged([out]), _Staged(ins)) for out, ins in pairs]
        reducer = self.reducer

        def run() -> None:
            for out, ins in staged:
                buffer = out.buffers[0]
                begin = partial(reducer.begin, op_name, buffer.numel(), buffer.dtype, f"reduce_scatter {op}",
                                len(staged))
                reducer.ops.reduce_scatter(buffer, ins.buffers, op, begin)
                out.back()

        outputs = [out for out, _ in pairs]
        return self._shm(op_name, outputs, run, self._record(recorded, outputs), [t for _, ins in pairs for t in ins])

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> Work:
        opts = opts or dist.ReduceScatterOptions()
        work = None
        if len(outputs) == 1 and len(inputs) == 1:
            work = self._scatter_reduced("reduce_scatter", [(outputs[0], list(inputs[0]))], reduction(opts.reduceOp))
        return work or self._fallback("reduce_scatter", "reduce_scatter", outputs, inputs, opts)

    def _scatter_pairs(self, output: torch.Tensor,
                       input: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        L = self.reducer.local_world
        if (not input.is_contiguous() or input.numel() != L * output.numel() or output.dtype != input.dtype
                or not output.numel()):
            return None
        return output, list(input.detach().reshape(-1).split(output.numel()))

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:
        opts = opts or dist.ReduceScatterOptions()
        pair = self._scatter_pairs(output, input)
        work = None
        if pair:
            work = self._scatter_reduced("reduce_scatter_tensor", [pair], reduction(opts.reduceOp),
                                         "reduce_scatter_tensor")
        return work or self._fallback("reduce_scatter_tensor", "_reduce_scatter_base", output, input, opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Work:
        opts = opts or dist.ReduceScatterOptions()
        pairs = []
        if len(outputs) == len(inputs):
            pairs = [self._scatter_pairs(o, i) for o, i in zip(outputs, inputs, strict=True)]
        work = None
        if pairs and all(pairs):
            work = self._scatter_reduced("reduce_scatter_tensor_coalesced", pairs, reduction(opts.reduceOp),
                                         "reduce_scatter_tensor_coalesced")
        return work or self._fallback("reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced", outputs,
                                      inputs, opts)

    # -- all_to_all -----------------------------------------------------------------------
    def _exchange_all(self, op: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                      written: list[torch.Tensor], recorded: list[torch.Tensor]) -> Work | None:
        L = self.reducer.local_world
        if len(outputs) != L or len(inputs) != L or not self._in_host([*outputs, *inputs]):
            return None
        if any(t.dtype != outputs[0].dtype for t in [*outputs, *inputs]):
            return None
        sends, receives = _Staged(inputs), _Staged(outputs)
        reducer = self.reducer

        def run() -> None:
            reducer.ops.all_to_all(receives.buffers, sends.buffers, partial(reducer.begin, op, -1, outputs[0].dtype,
                                                                            "all_to_all"))
            receives.back()

        return self._shm(op, written, run, self._record("all_to_all", recorded), inputs)

    def alltoall(self, outputs: Any, inputs: Any, opts: Any = None) -> Work:
        work = self._exchange_all("all_to_all", list(outputs), list(inputs), list(outputs), list(inputs))
        return work or self._fallback("all_to_all", "alltoall", outputs, inputs, opts or dist.AllToAllOptions())

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                          input_splits: list[int], opts: Any = None) -> Work:
        L = self.reducer.local_world
        work = None
        if output.is_contiguous() and input.is_contiguous() and output.dim() and input.dim():
            outs = _split_rows(output, output_splits, L)
            ins = _split_rows(input, input_splits, L)
            if outs is not None and ins is not None:
                work = self._exchange_all("all_to_all_single", outs, ins, [output], [input])
        return work or self._fallback("all_to_all_single", "all_to_all_single", output, input, output_splits,
                                      input_splits, opts or dist.AllToAllOptions())

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                      input_splits: list[int], opts: Any = None) -> Work:
        return self.all_to_all_single(output, input, output_splits, input_splits, opts)

    # -- barrier --------------------------------------------------------------------------
    def barrier(self, opts: Any = None) -> Work:
        if self.reducer.hosts != 1:
            return self._fallback("barrier", "barrier", opts or dist.BarrierOptions())
        reducer = self.reducer

        def run() -> None:  # the call header's hand-off is the barrier
            reducer.begin("barrier", 0, torch.uint8, "barrier")

        return self._shm("barrier", [], run, self._record("barrier", []))


def _split_rows(tensor: torch.Tensor, splits: list[int], parts: int) -> list[torch.Tensor] | None:
    """``tensor`` (contiguous) as ``parts`` pieces along dim 0: of ``splits`` rows each, or
    even ones where ``splits`` is empty; None where they do not add up."""
    rows = tensor.shape[0]
    if not splits:
        if rows % parts:
            return None
        splits = [rows // parts] * parts
    if len(splits) != parts or sum(splits) != rows or any(s < 0 for s in splits):
        return None
    return list(tensor.detach().split(list(splits)))
