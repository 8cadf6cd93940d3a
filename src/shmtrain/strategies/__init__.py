"""How workers share parameters: one module per method, selected by name."""

from shmtrain.strategies import ssgd  # noqa: F401  (registers)
from shmtrain.strategies import ps_grad  # noqa: F401  (registers)
from shmtrain.strategies import ps_weight  # noqa: F401  (registers)
from shmtrain.strategies import seasgd  # noqa: F401  (registers)
from shmtrain.strategies import easgd  # noqa: F401  (registers)
from shmtrain.strategies import downpour  # noqa: F401  (registers)
from shmtrain.strategies import hsgd  # noqa: F401  (registers)
from shmtrain.strategies.base import Strategy, StrategyConfig, get, register, registry

__all__ = ["Strategy", "StrategyConfig", "get", "register", "registry"]
