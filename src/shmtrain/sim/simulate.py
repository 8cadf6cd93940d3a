"""Simulate an allreduce at scales this machine cannot run (SCALE, swCaffe Figs. 10-11).

The simulator builds the algorithm's real schedule (the code that trains, from
:mod:`shmtrain.fabric.allreduce.collectives.algorithms`) for ``nodes`` ranks in contiguous
groups of ``group_size`` and runs it on the counting transport, which tallies steps
and bytes per link class and runs the alpha-beta-gamma clock. No buffer is allocated.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from shmtrain.fabric.allreduce.collectives.algorithms import ALGORITHMS, get_algorithm
from shmtrain.fabric.allreduce.collectives.counting import CountingTransport
from shmtrain.fabric.allreduce.collectives.schedule import Topology
from shmtrain.sim.model import CostModel

#: the units of ``shmtrain bench`` sizes: KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024
_UNITS = {
    "": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """``"97.7MB"`` -> 97700000, ``"97.7MiB"`` -> 102445875: a number with an optional
    unit (B, KB, MB, GB, TB: powers of 1000; KiB, MiB, GiB, TiB: powers of 1024).
    Raises ``ValueError`` naming ``--bytes``."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(
            f"--bytes {text!r} is not a size; write a number with an optional unit, "
            "e.g. 4096, 64KiB, 97.7MB, 1.5GiB"
        )
    value = round(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"--bytes {text!r} must be more than 0 bytes")
    return value


def format_bytes(n: float) -> str:
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


@dataclass
class SimRow:
    """One algorithm's simulated allreduce; bytes are per node, maxima over nodes."""

    algorithm: str
    steps: int
    bytes_inside: int
    bytes_across: int
    predicted_s: float
    bytes_reduced: int
    nodes: int
    group_size: int
    bytes: int
    phases: dict[str, dict[str, int]] = field(default_factory=dict)

    def as_json(self) -> dict:
        return asdict(self)


def check_shape(nodes: int, group_size: int) -> None:
    if not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"--nodes {nodes!r} must be a whole number of nodes >= 1")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"--group-size {group_size!r} must be a whole number of nodes >= 1")
    if nodes % group_size:
        divisors = [d for d in range(1, min(nodes, 4096) + 1) if nodes % d == 0]
        near = sorted(divisors, key=lambda d: abs(d - group_size))[:3]
        raise ValueError(
            f"--group-size {group_size} does not divide --nodes {nodes}: every group must "
            f"have the same number of nodes; try --group-size {' or '.join(map(str, sorted(near)))}"
        )


def simulate(
    algorithm: str,
    nodes: int,
    group_size: int,
    nbytes: int,
    model: CostModel | None = None,
    itemsize: int = 4,
) -> SimRow:
    """Run ``algorithm``'s schedule for ``nodes`` nodes on the counting transport."""
    check_shape(nodes, group_size)
    if nbytes <= 0:
        raise ValueError(f"--bytes {nbytes} must be more than 0 bytes")
    if itemsize < 1:
        raise ValueError(f"--itemsize {itemsize} must be at least 1 byte")
    builder = get_algorithm(algorithm)
    topology = Topology.uniform(nodes, group_size)
    numel = math.ceil(nbytes / itemsize)
    tally = CountingTransport(topology, itemsize, model or CostModel()).run(builder(topology, numel))
    return SimRow(
        algorithm=algorithm,
        steps=tally.steps,
        bytes_inside=tally.bytes_inside,
        bytes_across=tally.bytes_across,
        predicted_s=tally.predicted_s,
        bytes_reduced=tally.bytes_reduced,
        nodes=nodes,
        group_size=group_size,
        bytes=numel * itemsize,
        phases={name: tally.phase(name) for name in tally.phases},
    )


def simulate_all(
    nodes: int,
    group_size: int,
    nbytes: int,
    model: CostModel | None = None,
    algorithms: Sequence[str] | None = None,
    itemsize: int = 4,
) -> list[SimRow]:
    """:func:`simulate` for each algorithm (all by default), in order."""
    check_shape(nodes, group_size)
    names = list(algorithms) if algorithms else list(ALGORITHMS)
    for name in names:
        get_algorithm(name)
    return [simulate(name, nodes, group_size, nbytes, model, itemsize) for name in names]


def format_table(rows: Sequence[SimRow], model: CostModel) -> str:
    """One compact table per buffer size, fastest marked."""
    out = []
    sizes = list(dict.fromkeys(r.bytes for r in rows))
    for size in sizes:
        group = [r for r in rows if r.bytes == size]
        first = group[0]
        best = min(r.predicted_s for r in group)
        out.append(
            f"allreduce of {format_bytes(size)} ({size:,} B) over {first.nodes} nodes in "
            f"{first.nodes // first.group_size} groups of {first.group_size}"
        )
        out.append(
            f"alpha {model.alpha * 1e6:.3g} us, beta inside {model.beta_inside * 1e9:.3g} ns/B, "
            f"across {model.beta_across * 1e9:.3g} ns/B, gamma {model.gamma * 1e9:.3g} ns/B"
        )
        out.append(
            f"{'algorithm':<14}{'steps':>7}{'inside MB':>12}{'across MB':>12}"
            f"{'predicted ms':>15}{'x best':>8}"
        )
        for r in group:
            out.append(
                f"{r.algorithm:<14}{r.steps:>7}{r.bytes_inside / 1e6:>12.1f}"
                f"{r.bytes_across / 1e6:>12.1f}{r.predicted_s * 1e3:>15.2f}"
                f"{r.predicted_s / best if best else 1.0:>8.2f}"
            )
        out.append("")
    return "\n".join(out).rstrip() + "\n"
