"""How workers share parameters: one module per method, selected by name.

Families: ``ssgd/`` (synchronous SGD and its variants), ``elastic/`` (the shared-buffer
methods of ShmCaffe: Downpour, EASGD, SEASGD, HSGD), ``ps/`` (SHM-Learn-Dist's parameter
servers); ``gpi``, ``cpu_acc``, ``diloco`` and ``nocomm`` are one module each. Beside
them: ``base`` (the interface and the registry), ``parts`` (what several are built from),
``layout/`` (the flat parameter layout and its staging), ``optim/`` (stepping an optimizer
over part of the parameters).
"""

from shmtrain.strategies import (
    cpu_acc,  # noqa: F401  (registers)
    diloco,  # noqa: F401  (registers)
    gpi,  # noqa: F401  (registers)
    nocomm,  # noqa: F401  (registers)
    ssgd,  # noqa: F401  (registers)
)
from shmtrain.strategies.base import Strategy, StrategyConfig, get, register, registry
from shmtrain.strategies.elastic import (
    downpour,  # noqa: F401  (registers)
    easgd,  # noqa: F401  (registers)
    hsgd,  # noqa: F401  (registers)
    seasgd,  # noqa: F401  (registers)
)
from shmtrain.strategies.ps import grad, weight  # noqa: F401  (registers)

__all__ = ["Strategy", "StrategyConfig", "get", "register", "registry"]
