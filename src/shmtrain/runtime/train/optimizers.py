"""``--optimizer``: any ``torch.optim`` class by name, built from the config's
optimisation section.

The name is matched without regard to case (``adamw`` is :class:`torch.optim.AdamW`).
``--lr`` and ``--weight-decay`` go to every optimizer that takes them; ``--momentum`` to
those that take ``momentum`` (SGD: 0.9 when not given, the papers' value; others keep
their own default unless it is given); ``--optimizer-args 'k=v; k=v'`` adds any other
keyword argument (values are Python literals: ``betas=(0.9, 0.95)``). A keyword the
class does not take is refused with the ones it does. What the optimizer means under
each strategy (the averaged gradient's, the server's, each worker's local one) is in
docs/optimizers.md; a strategy that cannot honour one says so
(:meth:`shmtrain.strategies.base.Strategy.check_optimizer`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable
from typing import Any

import torch

from shmtrain.typed_options import parse_kwargs

#: the names ``--optimizer`` shows in ``--help`` first (every torch.optim class is accepted)
COMMON = ("sgd", "adamw", "adam", "rmsprop", "adagrad")


@functools.cache
def _classes() -> dict[str, type[torch.optim.Optimizer]]:
    found = {}
    for name in dir(torch.optim):
        value = getattr(torch.optim, name)
        if isinstance(value, type) and issubclass(value, torch.optim.Optimizer) and value is not torch.optim.Optimizer:
            found[name.lower()] = value
    return found


def optimizer_names() -> list[str]:
    """Every ``--optimizer`` name, the common ones first."""
    names = sorted(_classes())
    return [n for n in COMMON if n in names] + [n for n in names if n not in COMMON]


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class ``name`` names (any case); ValueError listing the names."""
    found = _classes().get(name.lower())
    if found is None:
        raise ValueError(f"--optimizer {name!r} is not a torch.optim class; choose one of: "
                         f"{', '.join(optimizer_names())}")
    return found


def parse_optimizer_args(text: str) -> dict[str, Any]:
    """``'k=v; k=v'`` -> keyword arguments (values are Python literals)."""
    return parse_kwargs(text, "--optimizer-args")


def _accepted(cls: type[torch.optim.Optimizer]) -> set[str]:
    return {p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "params")}


def default_momentum(name: str) -> float | None:
    """The momentum a run of ``--optimizer name`` uses when ``--momentum`` is not given
    (0.9 for SGD, the papers' value; the optimizer's own default for the others that take
    one; None for those that take none), so ``config.toml`` records it."""
    cls = optimizer_class(name)
    if cls is torch.optim.SGD:
        return 0.9
    parameter = inspect.signature(cls.__init__).parameters.get("momentum")
    if parameter is None or not isinstance(parameter.default, int | float) or isinstance(parameter.default, bool):
        return None
    return float(parameter.default)


def optimizer_kwargs(name: str, args: str, lr: float, momentum: float | None,
                     weight_decay: float) -> dict[str, Any]:
    """The keyword arguments of ``--optimizer name``: lr, weight decay and momentum where
    it takes them, then ``--optimizer-args``; ValueError naming a keyword it does not take."""
    cls = optimizer_class(name)
    accepted = _accepted(cls)
    kwargs: dict[str, Any] = {"lr": lr}
    if "weight_decay" in accepted:
        kwargs["weight_decay"] = weight_decay
    if momentum is not None or cls is torch.optim.SGD:
        if "momentum" not in accepted:
            takes = sorted(n for n, c in _classes().items() if "momentum" in _accepted(c))
            raise ValueError(f"--momentum {momentum} with --optimizer {name}: {cls.__name__} takes no "
                             f"momentum (those that do: {', '.join(takes)}); leave --momentum out"
                             + ("; Adam's momentum terms are its betas: --optimizer-args 'betas=(0.9, 0.999)'"
                                if "betas" in accepted else ""))
        kwargs["momentum"] = 0.9 if momentum is None else momentum
    extra = parse_optimizer_args(args)
    unknown = sorted(set(extra) - accepted)
    if unknown:
        raise ValueError(f"--optimizer-args: {cls.__name__} takes no {', '.join(unknown)}; it takes "
                         f"{', '.join(sorted(accepted))}")
    clash = sorted(set(extra) & {"lr", "weight_decay", "momentum"})
    if clash:
        raise ValueError(f"--optimizer-args sets {', '.join(clash)}: give "
                         f"{', '.join('--' + c.replace('_', '-') for c in clash)} as the flag instead")
    return kwargs | extra


#: what ``torch.optim.Optimizer`` says of an empty parameter list, once the class's own
#: option checks have passed
EMPTY = "empty parameter list"


def check_optimizer_options(name: str, args: str, momentum: float | None, weight_decay: float) -> None:
    """Refuse, before any worker starts, options ``build_optimizer`` would refuse (the
    optimizer's own checks included: it is built once on an empty parameter list, which
    ``torch.optim.Optimizer`` refuses only after the class has checked its options, and
    before anything that imports ``torch._dynamo``: the launcher stays without it)."""
    kwargs = optimizer_kwargs(name, args, 0.1, momentum, weight_decay)
    try:
        optimizer_class(name)([], **kwargs)
    except (ValueError, TypeError) as exc:
        if EMPTY in str(exc):
            return
        raise ValueError(f"--optimizer {name} with {kwargs}: {exc}") from None
    raise AssertionError(f"{name} accepted an empty parameter list")  # torch.optim refuses it


def build_optimizer(config: Any, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The run's optimizer over ``params`` from ``config``'s optimisation section
    (``optimizer``, ``optimizer_args``, ``lr``, ``momentum``, ``weight_decay``)."""
    kwargs = optimizer_kwargs(config.optimizer, config.optimizer_args, config.lr, config.momentum,
                              config.weight_decay)
    return optimizer_class(config.optimizer)(params, **kwargs)
