"""One rank of a group on the ``shm`` backend that runs collectives and reports what they
returned (run by tests/backend/test_ops.py, without torchrun).

``python backend_ops_script.py CASE RANK PORT WORLD_SIZE`` (LOCAL_WORLD_SIZE in the
environment makes hosts of that many ranks). Prints one JSON line starting with ``RESULT``:
the rank, the case's outputs (each tensor as its dtype and values), and the calls of each
op that went through shared memory and to gloo in this process.

Inputs are :func:`inputs` of (seed, rank): the test rebuilds them to compute the definition.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import shmtrain  # noqa: F401 - registers the "shm" backend
from shmtrain.backend import ShmBackend, shm_backend

#: integer dtypes and their names in the report
INTEGERS = {"int8": torch.int8, "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8}


def inputs(dtype: torch.dtype, numel: int, seed: int, rank: int) -> torch.Tensor:
    """A rank's integers over the dtype's whole range (so that sums wrap around), and
    small ones of either sign (so that rounding toward zero differs from the floor)."""
    info = torch.iinfo(dtype)
    g = torch.Generator().manual_seed(1000 * seed + rank)
    wide = torch.randint(info.min, info.max, (numel,), generator=g, dtype=torch.int64)
    small = torch.randint(max(info.min, -9), 10, (numel,), generator=g, dtype=torch.int64)
    return torch.where(torch.arange(numel) % 2 == 0, wide, small).to(dtype)


def report(tensor: torch.Tensor) -> dict:
    return {"dtype": str(tensor.dtype).replace("torch.", ""), "values": tensor.tolist()}


def avg_int(rank: int, world: int) -> dict:
    """AVG of each integer dtype: one tensor (and a strided one), and a coalesced call."""
    out = {}
    for seed, (name, dtype) in enumerate(INTEGERS.items()):
        t = inputs(dtype, 1001, seed, rank)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        out[f"{name}/one"] = report(t)
        wide = torch.zeros(2 * 37, dtype=dtype)
        wide[::2] = inputs(dtype, 37, seed + 10, rank)
        strided = wide[::2]
        dist.all_reduce(strided, op=dist.ReduceOp.AVG)
        out[f"{name}/strided"] = report(strided)
        pair = [inputs(dtype, 5, seed + 20, rank), inputs(dtype, 300, seed + 30, rank)]
        dist.all_reduce_coalesced(pair, op=dist.ReduceOp.AVG)
        out[f"{name}/coalesced0"], out[f"{name}/coalesced1"] = report(pair[0]), report(pair[1])
    return out


#: every dtype the collectives move, and those they reduce
MOVED = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.int32, torch.int64,
         torch.uint8, torch.bool, torch.complex64]
REDUCED = MOVED[:8]
FLOAT_OPS = ["SUM", "AVG", "MAX", "MIN", "PRODUCT"]
INT_OPS = ["SUM", "MAX", "MIN", "PRODUCT", "BAND", "BOR", "BXOR"]  # AVG: gloo raises (test_ops checks NCCL's)
#: numels: a small uneven one and one of several 1 MiB blocks
SIZES = [1001, 300_007]


def values(dtype: torch.dtype, shape: tuple[int, ...], seed: int, rank: int) -> torch.Tensor:
    """Whole numbers in [-3, 3] (so that sums and products of 4 ranks are exact in every
    dtype: the reductions must then equal gloo's bit for bit), [0, 3] for unsigned, bools."""
    g = torch.Generator().manual_seed(7919 * seed + rank)
    low = 0 if dtype in (torch.uint8, torch.bool) else -3
    high = 2 if dtype == torch.bool else 4
    t = torch.randint(low, high, shape, generator=g, dtype=torch.int64)
    if dtype.is_complex:
        return torch.complex(t.double(), t.flip(-1).double()).to(dtype)
    return t.to(dtype)


class Compare:
    """Runs each collective on the shm group and on a gloo group over the same ranks and
    records where they differ (bit for bit; AVG of floats within a few ulps)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.gloo = dist.new_group(backend="gloo")
        self.mismatches: list[str] = []
        self.gloo_lacks: list[str] = []
        self.checked = 0
        self.seed = 0
        #: where a list: each check's shm tensors' digest (a run repeats them on another path)
        self.digests: list[str] | None = None

    def check(self, name: str, run, make, approx: bool = False, compared: bool = True) -> None:
        """``run(tensors, group)`` on ``make()``'s tensors for both groups; their
        tensors afterwards must be equal (where ``compared``: not a reduce's non-root)."""
        self.seed += 1
        shm, gloo = make(self.seed), make(self.seed)
        run(shm, None)
        if self.digests is not None:
            self.digests.append(_digest(shm))
        try:
            run(gloo, self.gloo)
        except RuntimeError as exc:  # a dtype gloo lacks for this op (bool gather...): shm's is not compared
            self.gloo_lacks.append(f"{name}: {str(exc).splitlines()[0][:80]}")
            return
        for i, (a, b) in enumerate(zip(shm, gloo, strict=True)):
            if not compared:
                continue
            same = torch.allclose(a.double(), b.double(), rtol=1e-2, atol=1e-6) if approx else torch.equal(a, b)
            if not same or a.dtype != b.dtype:
                shown = [t.reshape(-1)[:6].tolist() for t in (a, b)]
                self.mismatches.append(f"{name} tensor {i}: shm {shown[0]} gloo {shown[1]}")
        self.checked += 1


def _reductions(c: Compare, rank: int, world: int) -> None:
    """all_reduce, reduce_scatter(_tensor), reduce and all_reduce_coalesced of every op and dtype."""
    op = dist.ReduceOp
    for dtype in REDUCED:
        for name in FLOAT_OPS if dtype.is_floating_point else INT_OPS:
            red = getattr(op, name)
            for n in SIZES:
                def one(seed, n=n, dtype=dtype):
                    return [values(dtype, (n,), seed, rank)]

                def scattered(seed, n=n, dtype=dtype):
                    return [torch.zeros(n, dtype=dtype), values(dtype, (world * n,), seed, rank)]

                c.check(f"all_reduce {name} {dtype} {n}",
                        lambda ts, g, red=red: dist.all_reduce(ts[0], op=red, group=g), one, approx=name == "AVG")
                if name == "AVG":
                    continue
                c.check(f"reduce_scatter_tensor {name} {dtype} {n}",
                        lambda ts, g, red=red: dist.reduce_scatter_tensor(ts[0], ts[1], op=red, group=g), scattered)
                c.check(f"reduce {name} {dtype} {n}",
                        lambda ts, g, red=red: dist.reduce(ts[0], dst=world - 1, op=red, group=g), one,
                        compared=rank == world - 1)

        def pieces(seed, dtype=dtype):
            return [torch.zeros(5, 3, dtype=dtype), *[values(dtype, (5, 3), seed + j, rank) for j in range(world)]]

        def pair(seed, dtype=dtype):
            return [values(dtype, (7,), seed, rank), values(dtype, (300,), seed + 1, rank)]

        c.check(f"reduce_scatter list {dtype}", lambda ts, g: dist.reduce_scatter(ts[0], list(ts[1:]), group=g), pieces)
        c.check(f"all_reduce_coalesced MAX {dtype}", lambda ts, g: dist.all_reduce_coalesced(ts, op=op.MAX, group=g),
                pair)
        c.check(f"all_reduce_coalesced SUM {dtype}", lambda ts, g: dist.all_reduce_coalesced(ts, group=g), pair)


def _moves(c: Compare, rank: int, world: int) -> None:
    """broadcast, all_gather(_into_tensor), all_to_all(_single), gather, scatter of every dtype."""
    for dtype in MOVED:
        for n in SIZES:
            def one(seed, n=n, dtype=dtype):
                return [values(dtype, (n,), seed, rank)]

            def gathered(seed, n=n, dtype=dtype):
                return [torch.zeros(world * n, dtype=dtype), values(dtype, (n,), seed, rank)]

            for root in (0, world - 1):
                c.check(f"broadcast {dtype} {n} from {root}",
                        lambda ts, g, root=root: dist.broadcast(ts[0], src=root, group=g), one)
            c.check(f"all_gather_into_tensor {dtype} {n}",
                    lambda ts, g: dist.all_gather_into_tensor(ts[0], ts[1], group=g), gathered)

        def listed(seed, dtype=dtype):
            return [values(dtype, (4, 3), seed, rank), *[torch.zeros(4, 3, dtype=dtype) for _ in range(world)]]

        c.check(f"all_gather list {dtype}", lambda ts, g: dist.all_gather(list(ts[1:]), ts[0], group=g), listed)
        # all_to_all_single, uneven: rank r sends r + 2j + 1 rows of 3 to rank j (x 800: some ranks'
        # data fits the call ring and some not; x 20000: many blocks)
        for scale in (1, 800, 20_000):
            sends = [(rank + 2 * j + 1) * scale for j in range(world)]
            receives = [(i + 2 * rank + 1) * scale for i in range(world)]

            def uneven(seed, dtype=dtype, sends=sends, receives=receives):
                return [torch.zeros(sum(receives), 3, dtype=dtype), values(dtype, (sum(sends), 3), seed, rank)]

            c.check(f"all_to_all_single uneven {dtype} x{scale}",
                    lambda ts, g, s=sends, r=receives: dist.all_to_all_single(ts[0], ts[1], r, s, group=g), uneven)

        def even(seed, dtype=dtype):
            return [torch.zeros(world * 2, 5, dtype=dtype), values(dtype, (world * 2, 5), seed, rank)]

        def lists(seed, dtype=dtype):  # gloo's list form takes tensors of one size
            return [*[torch.zeros(4, dtype=dtype) for i in range(world)],
                    *[values(dtype, (4,), seed + j, rank) for j in range(world)]]

        c.check(f"all_to_all_single even {dtype}", lambda ts, g: dist.all_to_all_single(ts[0], ts[1], group=g), even)
        c.check(f"all_to_all list {dtype}", lambda ts, g: dist.all_to_all(list(ts[:world]), list(ts[world:]), group=g),
                lists)
        for root in (0, world - 1):
            mine = rank == root

            def to_root(seed, dtype=dtype, mine=mine):
                return [values(dtype, (6,), seed, rank), *([torch.zeros(6, dtype=dtype) for _ in range(world)] * mine)]

            def from_root(seed, dtype=dtype, mine=mine):
                sent = [values(dtype, (6,), seed + j, rank) for j in range(world)] if mine else []
                return [torch.zeros(6, dtype=dtype), *sent]

            c.check(f"gather {dtype} to {root}", lambda ts, g, root=root, mine=mine: dist.gather(
                ts[0], list(ts[1:]) if mine else None, dst=root, group=g), to_root)
            c.check(f"scatter {dtype} from {root}", lambda ts, g, root=root, mine=mine: dist.scatter(
                ts[0], list(ts[1:]) if mine else None, src=root, group=g), from_root)


def every_op(rank: int, world: int) -> dict:
    """Every op and dtype on shm and on gloo (:class:`Compare`); what differed."""
    c = Compare(rank, world)
    op = dist.ReduceOp
    _reductions(c, rank, world)
    _moves(c, rank, world)
    # strided tensors, against gloo on a contiguous copy (gloo takes a strided tensor's
    # numel elements from its first byte on: MAX of t[::2] reduced t[:15])
    def strided(call):
        def run(ts, g):
            view = ts[0][:, 1]
            if g is None:
                call(view, None)
            else:
                copy = view.contiguous()
                call(copy, g)
                view.copy_(copy)
        return run

    c.check("broadcast strided", strided(lambda t, g: dist.broadcast(t, src=0, group=g)),
            lambda seed: [values(torch.float32, (9, 4), seed, rank)])
    c.check("all_reduce MAX strided", strided(lambda t, g: dist.all_reduce(t, op=op.MAX, group=g)),
            lambda seed: [values(torch.float32, (9, 4), seed, rank)])
    # the coalesced forms (the backend's own methods, as _coalescing_manager calls them),
    # against gloo one tensor at a time
    backend = shm_backend()
    sizes = (3, 1001, 300_007)

    def gather_coalesced(ts, g):
        ins, outs = ts[:3], ts[3:]
        if g is None:
            backend.all_gather_single_coalesced(outs, ins).wait()
        else:
            for out, inp in zip(outs, ins, strict=True):
                dist.all_gather_into_tensor(out, inp, group=g)

    c.check("all_gather_into_tensor coalesced", gather_coalesced,
            lambda seed: [*[values(torch.float32, (n,), seed + n, rank) for n in sizes],
                          *[torch.zeros(world * n) for n in sizes]])

    def scatter_coalesced(ts, g):
        outs, ins = ts[:3], ts[3:]
        if g is None:
            backend.reduce_scatter_single_coalesced(outs, ins, dist.ReduceScatterOptions()).wait()
        else:
            for out, inp in zip(outs, ins, strict=True):
                dist.reduce_scatter_tensor(out, inp, group=g)

    c.check("reduce_scatter_tensor coalesced", scatter_coalesced,
            lambda seed: [*[torch.zeros(n, dtype=torch.int64) for n in sizes],
                          *[values(torch.int64, (world * n,), seed + n, rank) for n in sizes]])

    def gather_lists(ts, g):  # torch's form: outputs[r] holds rank r's inputs
        ins, outs = ts[:2], [[ts[2 + 2 * r], ts[3 + 2 * r]] for r in range(world)]
        if g is None:
            dist.all_gather_coalesced(outs, ins)
        else:
            for k, inp in enumerate(ins):
                dist.all_gather([out[k] for out in outs], inp, group=g)

    c.check("all_gather_coalesced", gather_lists,
            lambda seed: [values(torch.float64, (5,), seed, rank), values(torch.float64, (2, 3), seed + 1, rank),
                          *[t for _ in range(world) for t in (torch.zeros(5, dtype=torch.float64),
                                                              torch.zeros(2, 3, dtype=torch.float64))]])
    dist.barrier()
    return {"mismatches": c.mismatches, "checked": c.checked, "gloo_lacks": c.gloo_lacks}


def _calls(rank: int, world: int) -> dict:
    """One asynchronous call of each op the backend declares (its Work)."""
    t = torch.ones(1000)
    op = dist.ReduceOp
    many = [torch.ones(1000) for _ in range(world)]
    return {
        "all_reduce MAX": lambda: dist.all_reduce(t, op=op.MAX, async_op=True),
        "all_reduce_coalesced MIN": lambda: dist.all_reduce_coalesced([t, t[:5].clone()], op=op.MIN, async_op=True),
        "broadcast": lambda: dist.broadcast(t, src=0, async_op=True),
        "all_gather": lambda: dist.all_gather(many, t, async_op=True),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.zeros(world * 1000), t, async_op=True),
        "reduce_scatter": lambda: dist.reduce_scatter(t, many, async_op=True),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(t, torch.ones(world * 1000), async_op=True),
        "all_to_all": lambda: dist.all_to_all(many, [m.clone() for m in many], async_op=True),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.zeros(world * 10), torch.ones(world * 10),
                                                            async_op=True),
        "reduce": lambda: dist.reduce(t, dst=0, async_op=True),
        "gather": lambda: dist.gather(t, many if rank == 0 else None, dst=0, async_op=True),
        "scatter": lambda: dist.scatter(t, many if rank == 0 else None, src=0, async_op=True),
        "barrier": lambda: dist.barrier(async_op=True),
        # larger than the call ring: the ops' ring (in C where the library is there)
        "all_gather_into_tensor large": lambda: dist.all_gather_into_tensor(torch.zeros(world * 100_000),
                                                                            torch.ones(100_000), async_op=True),
        "reduce_scatter_tensor large": lambda: dist.reduce_scatter_tensor(torch.zeros(100_000),
                                                                          torch.ones(world * 100_000), async_op=True),
    }


def peer_dies(rank: int, world: int) -> dict:
    """Rank 1 exits after a first barrier; rank 0 calls $FIRST_OP (which waits for it), then
    every other op: what each Work's wait() (or the call) raised, and how long it took."""
    import os
    import time

    dist.barrier()
    if rank == 1:
        os._exit(0)
    calls = _calls(rank, world)
    first = os.environ["FIRST_OP"]
    out = {}
    for name in [first, *[n for n in calls if n != first]]:
        start = time.monotonic()
        try:
            calls[name]().wait()
            out[name] = {"raised": None}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[name] = {"raised": type(exc).__name__, "text": str(exc), "seconds": time.monotonic() - start}
    return out


def hand_offs(rank: int, world: int) -> dict:
    """Ops of a small (4 KB) and a large (400 KB) float tensor: whether each result is right,
    and what each call took: call ring hand-offs, blocks of the ops' ring and of the pipeline."""
    reducer = shm_backend().reducer
    total, op = world * (world + 1) / 2, dist.ReduceOp

    def full(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((numel,), float(rank + 1), dtype=dtype)

    def reduced(t: torch.Tensor, red=None) -> bool:
        dist.all_reduce(t, **({"op": red} if red else {}))
        return bool((t == (total if red is None else world)).all())

    def gathered(numel: int) -> bool:
        out = torch.zeros(world * numel)
        dist.all_gather_into_tensor(out, full(numel))
        return bool((out.view(world, numel) == torch.arange(1, world + 1).view(world, 1)).all())

    def scattered(numel: int) -> bool:
        out = torch.zeros(numel)
        dist.reduce_scatter_tensor(out, full(world * numel))
        return bool((out == total).all())

    def exchanged(numel: int) -> bool:
        out = torch.zeros(world * numel)
        dist.all_to_all_single(out, full(world * numel))
        return bool((out.view(world, numel) == torch.arange(1, world + 1).view(world, 1)).all())

    def broadcast(numel: int) -> bool:
        t = full(numel)
        dist.broadcast(t, src=world - 1)
        return bool((t == world).all())

    cases = {"all_reduce SUM float32": lambda n: reduced(full(n)),
             "all_reduce AVG float32": lambda n: dist.all_reduce(t := full(n), op=op.AVG) or bool(
                 torch.allclose(t, torch.full_like(t, total / world))),
             "all_reduce SUM float64": lambda n: reduced(full(n, torch.float64)),
             "all_reduce SUM int64": lambda n: reduced(full(n, torch.int64)),
             "all_reduce MAX float32": lambda n: reduced(full(n), op.MAX),
             "broadcast": broadcast, "all_gather_into_tensor": gathered, "reduce_scatter_tensor": scattered,
             "all_to_all_single": exchanged}
    out = {}
    for size, numel in (("small", 1000), ("large", 100_000)):
        for name, case in cases.items():
            before = (reducer.calls_ring.seq, reducer.ops.blocks, reducer.pipeline.blocks)
            right = case(numel)
            after = (reducer.calls_ring.seq, reducer.ops.blocks, reducer.pipeline.blocks)
            calls, ring, pipeline = (a - b for a, b in zip(after, before, strict=True))
            out[f"{name} {size}"] = {"right": right, "calls": calls, "ring_blocks": ring, "pipeline_blocks": pipeline}
    return out


def threads(rank: int, world: int) -> dict:
    """With a reduction thread (``SHMTRAIN_PG_THREAD=1``): small calls (async ones too) run
    on the caller's thread, done when they return, none handed to the thread; a large one
    goes to it."""
    backend = shm_backend()
    reducer = backend.reducer
    t = torch.ones(1000)
    work = backend.allreduce([t])
    out = {"inline": reducer.inline, "small_done_at_once": work.is_completed()}
    work.wait()
    dist.broadcast(t, src=0)
    dist.all_gather_into_tensor(torch.zeros(world * 1000), t)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.barrier()
    dist.all_reduce(t, async_op=True).wait()
    out["queued_after_small"] = reducer.queued
    big = torch.ones(100_000)
    dist.all_reduce(big)
    out["queued_after_large"] = reducer.queued
    out["values"] = [float(t[0]), float(big[0])]
    return out


def _digest(tensors: list[torch.Tensor]) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def compiled_ring(rank: int, world: int) -> dict:
    """The float32 reductions and moves larger than the call ring (several blocks of the ops'
    ring, uneven sizes) against gloo bit for bit (:class:`Compare`): on random floats, but
    for the sums and products of more than 2 ranks, whose order of terms is gloo's own (on
    whole numbers there: exact in any order); every result's digest, which a run with
    ``SHMTRAIN_NATIVE=0`` (the Python path) must repeat; the same with NaNs, infinities
    and zeros of either sign in some blocks (blocks the compiled path hands back to torch);
    and how many blocks were handed back."""
    c = Compare(rank, world)
    c.digests = []
    op = dist.ReduceOp
    ops = shm_backend().reducer.ops

    def randn(shape: tuple[int, ...], seed: int) -> torch.Tensor:
        return torch.randn(shape, generator=torch.Generator().manual_seed(7919 * seed + rank))

    for n in (70_001, 300_007):
        for name in FLOAT_OPS:
            red = getattr(op, name)
            exact = world > 2 and name in ("SUM", "AVG", "PRODUCT")

            def make(shape: tuple[int, ...], seed: int, exact: bool = exact) -> torch.Tensor:
                return values(torch.float32, shape, seed, rank) if exact else randn(shape, seed)

            c.check(f"reduce_scatter_tensor {name} {n}",
                    lambda ts, g, red=red: dist.reduce_scatter_tensor(ts[0], ts[1], op=red, group=g),
                    lambda seed, n=n, make=make: [torch.zeros(n), make((world * n,), seed)])
            if name not in ("SUM", "AVG"):  # those are the pipeline's
                c.check(f"all_reduce {name} {n}", lambda ts, g, red=red: dist.all_reduce(ts[0], op=red, group=g),
                        lambda seed, n=n, make=make: [make((n,), seed)])
            c.check(f"reduce {name} {n}", lambda ts, g, red=red: dist.reduce(ts[0], dst=world - 1, op=red, group=g),
                    lambda seed, n=n, make=make: [make((n,), seed)], compared=rank == world - 1)
            if exact:  # the compiled path against the Python path on random floats (a run each)
                t = [torch.zeros(n), randn((world * n,), 1000 + c.seed)]
                dist.reduce_scatter_tensor(t[0], t[1], op=red)
                c.digests.append(_digest(t[:1]))

        def in_place(ts, g):  # FSDP2's all-gather: its input is this rank's piece of its output
            out = ts[0]
            dist.all_gather_into_tensor(out, out.view(world, -1)[rank], group=g)

        c.check(f"all_gather_into_tensor in place {n}", in_place,
                lambda seed, n=n: [randn((world * n,), seed)])
        c.check(f"all_gather_into_tensor {n}", lambda ts, g: dist.all_gather_into_tensor(ts[0], ts[1], group=g),
                lambda seed, n=n: [torch.zeros(world * n), randn((n,), seed)])
        for root in (0, world - 1):
            c.check(f"broadcast {n} from {root}", lambda ts, g, root=root: dist.broadcast(ts[0], src=root, group=g),
                    lambda seed, n=n: [randn((n,), seed)])
            c.check(f"gather {n} to {root}", lambda ts, g, root=root: dist.gather(
                ts[0], list(ts[1:]) if rank == root else None, dst=root, group=g),
                lambda seed, n=n, root=root: [randn((n,), seed), *([torch.zeros(n) for _ in range(world)]
                                                                   * (rank == root))])
    # special values: a NaN on rank 0, zeros of opposite signs and infinities on the others,
    # in the first block of every destination; the other blocks are plain
    n = 300_007
    special = {}
    for name in FLOAT_OPS:
        red = getattr(op, name)
        x = randn((world * n,), 99)
        x[n - 3] = float("inf") * (-1) ** rank
        for j in range(world):
            if rank == 0:
                x[j * n + 11] = float("nan")
            x[j * n + 40] = -0.0 if rank % 2 else 0.0
            x[j * n + 41] = 0.0 if rank % 2 else -0.0
        out = torch.zeros(n)
        dist.reduce_scatter_tensor(out, x.clone(), op=red)
        one = x[:n].clone()
        dist.all_reduce(one, op=red) if name not in ("SUM", "AVG") else None
        special[name] = _digest([out, one])
    dist.barrier()
    return {"mismatches": c.mismatches, "checked": c.checked, "special": special, "digests": c.digests,
            "handed_back": ops.handed_back, "compiled": ops.lib is not None}


CASES = {"avg_int": avg_int, "every_op": every_op, "hand_offs": hand_offs, "peer_dies": peer_dies, "threads": threads,
         "compiled_ring": compiled_ring}

if __name__ == "__main__":
    case, rank, port, world = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    dist.init_process_group("shm", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    before, fallbacks = ShmBackend.reductions, ShmBackend.fallbacks
    outputs = CASES[case](rank, world)
    result = {"rank": rank, "outputs": outputs, "reductions": ShmBackend.reductions - before,
              "fallbacks": ShmBackend.fallbacks - fallbacks, "through_shm": dict(ShmBackend.through_shm),
              "through_gloo": dict(ShmBackend.through_gloo)}
    if case != "peer_dies":  # a failed group is left to the interpreter's exit
        dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)
