"""Allreduce algorithms written once as schedules, run by real and counting transports.

swCaffe Section V-A (RHD, TOPO), with ring, binomial tree and hierarchical variants as
comparison points. Layout:

- :mod:`.schedule`: :class:`Round` (parallel transfers over buffer ranges),
  :class:`Topology` (groups of ranks), per-rank plans.
- :mod:`.algorithms`: ring, rhd, tree, topo, hierarchical as schedule builders.
- :mod:`.transport`: the point-to-point interface, in-process peers, gloo.
- :mod:`.executor`: run a schedule on one rank's buffer over a transport.
- :mod:`.counting`: run a schedule for all ranks at once without data (the simulator).
- :mod:`.reducers`, :mod:`.autotune`: objects for training; :mod:`.factory`: ``build_allreduce``.

Schedules and counting need only numpy; the torch-based names load on first use, so
``shmtrain sim`` does not pay for importing torch.
"""

from importlib import import_module

from shmtrain.fabric.allreduce.collectives.algorithms import ALGORITHMS, get_algorithm
from shmtrain.fabric.allreduce.collectives.counting import CountingTransport, Tally
from shmtrain.fabric.allreduce.collectives.schedule import Round, Topology, check, plan_for

_LAZY = {
    "CHOICES": "reducers",
    "GlooAllreduce": "reducers",
    "ScheduledAllreduce": "reducers",
    "build_allreduce": "factory",
    "AutotunedAllreduce": "autotune",
    "allreduce": "executor",
    "execute": "executor",
    "GlooTransport": "transport",
    "InProcessTransport": "transport",
    "InProcessWorld": "transport",
    "Transport": "transport",
    "TransportTimeout": "transport",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ALGORITHMS",
    "CountingTransport",
    "Round",
    "Tally",
    "Topology",
    "check",
    "get_algorithm",
    "plan_for",
    *_LAZY,
]
