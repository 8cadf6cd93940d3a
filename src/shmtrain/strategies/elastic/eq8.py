"""ShmCaffe eq. (8), the SEASGD family's iteration time, checked on a run's metrics.

T_iter = max[T_comp, T_wwi + T_ugw] + T_rgw + T_ulw (ShmCaffe Section III-C, Fig. 6):
the update thread's write of the weight increment (``wwi``) and update of the global
weights (``ugw``) overlap the main thread's computation, while reading the global
weights (``rgw``) and updating the local ones (``ulw``) do not. ``seasgd`` and the roots
of ``hsgd`` run that exchange, so both report this check in ``summary.json``
(:class:`Eq8Metrics`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

MAIN_THREAD_TOTALS = ("compute", "comm")  # sums of other phases, not phases of their own
UPDATE_THREAD_PHASES = ("wwi", "ugw")  # overlapped with the main thread


def check_eq8(rows: Iterable[Mapping[str, Any]], *, skip: int = 1, tolerance: float = 0.15) -> dict:
    """Check ShmCaffe eq. (8) on one worker's metrics rows.

    T_iter = max[T_comp, T_wwi + T_ugw] + T_rgw + T_ulw, with the per-iteration means
    of the phases. The measured T_iter is the row's ``iteration`` (or ``total``) time if
    the loop records one, else the sum of the main thread's phases. Eq. (8) holds when
    the main thread's wait for the update thread is what the overlap predicts:
    measured and predicted T_iter agree within ``tolerance`` (relative).

    Args:
        rows: ``{"iteration", "loss", "time": {phase: seconds}}`` dicts (JSONL rows).
        skip: leading rows left out (warm-up).
        tolerance: relative difference accepted between measured and predicted T_iter.

    Returns:
        means ``T_comp``, ``T_rgw``, ``T_ulw``, ``T_wwi``, ``T_ugw``, ``T_wait`` (s),
        ``T_iter`` (measured), ``T_iter_eq8`` (predicted), ``exposed_comm`` (wait + rgw
        + ulw, s), ``exposed_fraction`` (of T_iter), ``relative_error``, ``holds``,
        ``iterations``.
    """
    times = [dict(row["time"]) for row in list(rows)[skip:] if "time" in row]
    n = len(times)
    if n == 0:
        raise ValueError("check_eq8 needs at least one metrics row after the warm-up rows")

    def mean(name: str) -> float:
        return sum(t.get(name, 0.0) for t in times) / n

    def measured(t: Mapping[str, float]) -> float:
        for name in ("iteration", "total"):
            if name in t:
                return t[name]
        return sum(
            v for k, v in t.items() if k not in MAIN_THREAD_TOTALS + UPDATE_THREAD_PHASES
        )

    comp = mean("compute")
    rgw, ulw, wwi, ugw, wait = (mean(k) for k in ("rgw", "ulw", "wwi", "ugw", "wait"))
    t_iter = sum(measured(t) for t in times) / n
    other = t_iter - comp - rgw - ulw - wait  # data loading and the like, outside eq. (8)
    predicted = max(comp, wwi + ugw) + rgw + ulw + max(other, 0.0)
    error = abs(t_iter - predicted) / t_iter if t_iter > 0 else 0.0
    exposed = wait + rgw + ulw
    return {
        "iterations": n,
        "T_comp": comp, "T_rgw": rgw, "T_ulw": ulw, "T_wwi": wwi, "T_ugw": ugw, "T_wait": wait,
        "T_iter": t_iter, "T_iter_eq8": predicted,
        "exposed_comm": exposed, "exposed_fraction": exposed / t_iter if t_iter > 0 else 0.0,
        "relative_error": error, "holds": error <= tolerance,
    }


def eq8_metrics(rows: Mapping[int, list[Mapping[str, Any]]]) -> dict[str, Any]:
    """``{"eq8": {rank: check_eq8(...)}}`` for a run's metrics rows (rank -> rows), the
    warm-up rows left out; what ``summary.json`` holds for the SEASGD family."""
    return {"eq8": {rank: check_eq8(r, skip=2) for rank, r in rows.items() if len(r) > 2}}


def describe_eq8(summary: Mapping[str, Any]) -> list[str]:
    """One line for the end of ``shmtrain train``: does eq. (8) hold on every worker?"""
    checks = summary.get("eq8", {}).values()
    if not checks:
        return []
    worst = max(c["relative_error"] for c in checks)
    holds = all(c["holds"] for c in checks)
    return [f"ShmCaffe eq. (8) T_iter = max[T_comp, T_wwi + T_ugw] + T_rgw + T_ulw: "
            f"{'holds' if holds else 'does NOT hold'} on every worker (worst relative error {worst:.1%})"]


class Eq8Metrics:
    """Mixin of the strategies that run the SEASGD exchange: eq. (8) in their summary."""

    @classmethod
    def check_metrics(cls, rows: Mapping[int, list[Mapping[str, Any]]]) -> dict[str, Any] | None:
        """Eq. (8) of ShmCaffe on every worker's metrics (see :func:`check_eq8`)."""
        return eq8_metrics(rows)

    @classmethod
    def describe_metrics(cls, summary: Mapping[str, Any]) -> list[str]:
        return describe_eq8(summary)
