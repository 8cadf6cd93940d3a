"""Counting the strategy checks a route makes (the variant's choice and conflict rule,
the hosts, the world, the optimizer), in whichever process they run."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

#: the classmethods of a strategy that check or resolve its job
CHECKS = ("choose", "check_variants", "check_hosts", "check_world", "check_optimizer")


@contextlib.contextmanager
def counting() -> Iterator[Counter]:
    """Count every call of :data:`CHECKS` on every strategy class while inside."""
    from shmtrain import strategies
    from shmtrain.strategies.base import Strategy

    classes: set[type] = {Strategy}
    for cls in strategies.registry().values():
        classes |= {c for c in cls.__mro__ if isinstance(c, type) and issubclass(c, Strategy)}
        for sub in list(cls.__subclasses__()):
            classes.add(sub)
    counts: Counter = Counter()
    saved = []
    for cls in classes:
        for name in CHECKS:
            if name in cls.__dict__:
                raw = cls.__dict__[name]
                func = raw.__func__

                def counted(klass, *args, _func=func, _name=name, **kwargs):
                    counts[_name] += 1
                    return _func(klass, *args, **kwargs)

                saved.append((cls, name, raw))
                setattr(cls, name, classmethod(counted))
    try:
        yield counts
    finally:
        for cls, name, raw in saved:
            setattr(cls, name, raw)
