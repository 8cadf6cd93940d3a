"""How workers share parameters: one module per method, selected by name."""

from shmtrain.strategies import (
    cpu_acc,  # noqa: F401  (registers)
    diloco,  # noqa: F401  (registers)
    downpour,  # noqa: F401  (registers)
    easgd,  # noqa: F401  (registers)
    gpi,  # noqa: F401  (registers)
    hsgd,  # noqa: F401  (registers)
    nocomm,  # noqa: F401  (registers)
    ps_grad,  # noqa: F401  (registers)
    ps_weight,  # noqa: F401  (registers)
    seasgd,  # noqa: F401  (registers)
    ssgd,  # noqa: F401  (registers)
)
from shmtrain.strategies.base import Strategy, StrategyConfig, get, register, registry

__all__ = ["Strategy", "StrategyConfig", "get", "register", "registry"]
