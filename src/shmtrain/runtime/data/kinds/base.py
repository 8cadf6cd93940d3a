"""What every kind of ``--data`` is: a class with a nested typed ``Config`` (docs/data.md).

A kind says which ``--data`` values it :meth:`~DataKind.matches`, which of the data
options it takes (the fields of its ``Config``: any other data option given with it is
refused, naming the fix), how it settles their defaults (:meth:`~DataKind.configure`),
whether its workers need torchvision, and how its ``Config`` opens the data
(:meth:`DataConfig.build`) or tells the launcher its facts without loading it
(:meth:`DataConfig.facts`). The kinds are listed once, in :mod:`shmtrain.runtime.data.kinds`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from shmtrain.runtime.data.sources import DataFacts, DataSource, resident_bytes


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """A kind's settled options; its fields are the data options the kind takes."""

    #: the value of ``--data``
    data: str

    def build(self) -> DataSource:
        """The training and held-out sets (in a worker, and once in the launcher)."""
        raise NotImplementedError

    def facts(self) -> DataFacts:
        """The data's size, input shape and classes, checked before any worker starts: the
        data is opened as a worker opens it, and what that cost this process (its resident
        memory while the data is open) is ``open_bytes``, which every worker pays too."""
        before = resident_bytes()
        source = self.build()
        facts = source.facts()
        if facts.in_memory:  # tensors: the memory check counts them by their size
            return facts
        return replace(facts, open_bytes=max(0, resident_bytes() - before))


class DataKind:
    """One kind of ``--data``. Subclass it, give it a ``Config`` (a
    :class:`DataConfig` subclass), and list it in :data:`shmtrain.runtime.data.kinds.KINDS`."""

    #: how messages name it, after "applies to" (e.g. "a folder --data")
    label: ClassVar[str]
    #: its workers import torchvision (its datasets and transforms)
    torchvision: ClassVar[bool] = False
    Config: ClassVar[type[DataConfig]] = DataConfig

    @classmethod
    def matches(cls, data: str) -> bool:
        """Whether ``--data`` names this kind."""
        raise NotImplementedError

    @classmethod
    def configure(cls, options: Any) -> DataConfig:
        """Settle the defaults of this kind's options on ``options`` (a ``TrainConfig``,
        so ``config.toml`` records what the run used) and return its ``Config``."""
        raise NotImplementedError

    @classmethod
    def takes(cls) -> frozenset[str]:
        """The data options this kind takes: its ``Config``'s fields."""
        import dataclasses

        return frozenset(f.name for f in dataclasses.fields(cls.Config))


def config_of(kind: type[DataKind], options: Any) -> DataConfig:
    """``kind.Config`` filled from the settled flat options of the same names."""
    import dataclasses

    return kind.Config(**{f.name: getattr(options, f.name) for f in dataclasses.fields(kind.Config)})
