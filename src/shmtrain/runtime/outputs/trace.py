"""``trace.json``: every rank's iterations on one timeline (Chrome / Perfetto trace format).

Built after the run from ``metrics/rank-<r>.jsonl`` (``--trace``): one track per rank
(``pid`` = ``tid`` = rank, named ``rank r`` by ``process_name`` / ``thread_name``
metadata events), and per iteration one complete event (``"ph": "X"``) named
``iteration N`` from the row's start ``t0`` over its measured ``iteration`` time, with
the leaf phases nested inside it, back to back in the loop's order:

``data`` -> ``forward`` -> ``backward`` -> ``update`` -> ``other``

``other`` is the rest of the iteration (the strategy's exchanges outside ``update``, such
as ssgd's allreduce after backward or a parameter server's broadcast, zero_grad, the
scheduler), so the leaves sum to the iteration time. The derived and strategy-specific
phases (``compute`` = forward + backward + update, ``comm``, ``collect_remaining``,
``gather``, ...) overlap the leaves, and where inside the iteration they ran is not
recorded, so they are arguments (ms) of the iteration's event, not slices. Rank 0's
held-out evaluations are ``eval`` events between iterations. Timestamps and durations
are integer microseconds from the earliest start of any rank (``otherData.t0_epoch_s``
is that start as seconds since the epoch), so nested events nest exactly.

Open it in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shmtrain.runtime.files import write_output

#: the loop's phases that do not overlap, in the order one iteration runs them
LEAVES = ("data", "forward", "backward", "update")
#: the slice that fills each iteration up to its measured time
OTHER = "other"


def build_trace(rows: dict[int, list[dict[str, Any]]],
                evals: dict[int, list[dict[str, Any]]] | None = None) -> dict[str, Any]:
    """The trace (JSON object format) of ``rows`` (rank -> iteration rows) and ``evals``
    (rank -> ``eval`` entries); rows without ``t0`` are laid out back to back."""
    evals = evals or {}
    starts = [row["t0"] for rank_rows in rows.values() for row in rank_rows if "t0" in row]
    starts += [e["t0"] for entries in evals.values() for e in entries if "t0" in e]
    origin = min(starts) if starts else 0.0
    events: list[dict[str, Any]] = []
    for rank in sorted(set(rows) | set(evals)):
        name = {"name": f"rank {rank}"}
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": rank, "args": name})
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": rank, "args": name})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": rank,
                       "args": {"sort_index": rank}})
        cursor = 0.0  # seconds from the origin, for rows without t0
        for row in rows.get(rank, []):
            start = row["t0"] - origin if "t0" in row else cursor
            events.extend(iteration_events(rank, row, start))
            cursor = start + row["time"].get("iteration", 0.0)
        for entry in evals.get(rank, []):
            if "t0" in entry:
                begin = _us(entry["t0"] - origin)
                events.append({
                    "name": "eval", "cat": "eval", "ph": "X", "pid": rank, "tid": rank, "ts": begin,
                    "dur": max(0, _us(entry["t0"] - origin + entry["time"]) - begin),
                    "args": {k: v for k, v in entry.items() if k not in ("t0", "time", "weights")},
                })
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"t0_epoch_s": origin, "leaves": [*LEAVES, OTHER]}}


def iteration_events(rank: int, row: dict[str, Any], start: float) -> list[dict[str, Any]]:
    """The ``iteration N`` event of one metrics row starting ``start`` seconds after the
    origin, and its leaf phases inside it (integer microseconds, tiling it exactly)."""
    phases: dict[str, float] = row["time"]
    total = phases.get("iteration") or sum(phases.get(p, 0.0) for p in LEAVES)
    args: dict[str, Any] = {"iteration": row["iteration"], "loss": row.get("loss")}
    if row.get("lr") is not None:
        args["lr"] = row["lr"]
    args.update({f"{name}_ms": round(s * 1e3, 4) for name, s in phases.items() if name not in LEAVES})
    begin, end = _us(start), _us(start + total)
    events = [{"name": f"iteration {row['iteration']}", "cat": "iteration", "ph": "X", "pid": rank,
               "tid": rank, "ts": begin, "dur": end - begin, "args": args}]
    offset = 0.0
    edge = begin
    for name in LEAVES:
        offset = min(total, offset + phases.get(name, 0.0))
        nxt = _us(start + offset)
        events.append({"name": name, "cat": "phase", "ph": "X", "pid": rank, "tid": rank,
                       "ts": edge, "dur": nxt - edge})
        edge = nxt
    events.append({"name": OTHER, "cat": "phase", "ph": "X", "pid": rank, "tid": rank,
                   "ts": edge, "dur": end - edge,
                   "args": {"note": "time outside data/forward/backward/update: exchanges "
                                    "after backward or after update, zero_grad, scheduler"}})
    return events


def write_trace(out: Path, rows: dict[int, list[dict[str, Any]]],
                evals: dict[int, list[dict[str, Any]]] | None = None) -> Path:
    """Write ``out/trace.json``; its path."""
    path = out / "trace.json"
    write_output(path, (json.dumps(build_trace(rows, evals)) + "\n").encode())
    return path


def _us(seconds: float) -> int:
    return round(seconds * 1e6)
