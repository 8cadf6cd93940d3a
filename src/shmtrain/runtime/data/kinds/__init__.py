"""The kinds of ``--data``, one class each (docs/data.md, "Add a kind of data").

To add one: a module here with a :class:`~shmtrain.runtime.data.kinds.base.DataKind`
subclass (its nested ``Config``, ``matches``, ``configure``, ``Config.build``), and one
line registering it in :data:`KINDS` (by its class name). The first kind whose ``matches``
is true, in the order they were registered, is the one; ``Folder`` claims whatever is
left, so it stays last.
"""

from __future__ import annotations

from typing import Any

from shmtrain.registry import Registry
from shmtrain.runtime.data.kinds.base import DataConfig, DataKind
from shmtrain.runtime.data.kinds.digits import Digits
from shmtrain.runtime.data.kinds.folder import Folder
from shmtrain.runtime.data.kinds.synthetic import Synthetic
from shmtrain.runtime.data.kinds.user import UserData
from shmtrain.runtime.data.sources import DataFacts

#: the kinds of ``--data``, in the order ``kind_of`` asks them
KINDS: Registry[type[DataKind]] = Registry("data kind", "--data")
for _kind in (Digits, Synthetic, UserData, Folder):
    KINDS.add(_kind.__name__, _kind)

#: the data options that only some kinds take: a given one the kind does not take is refused
#: (option -> whether it was given)
KIND_OPTIONS = {
    "data_args": lambda v: v != "", "val_data": lambda v: v is not None,
    "transform": lambda v: v is not None, "loader_workers": lambda v: v is not None,
    "input_shape": lambda v: v is not None, "samples": lambda v: v is not None,
    "image_size": lambda v: v is not None, "skip_bad_files": bool,
    "val_fraction": lambda v: v is not None,
}


def kind_of(data: str) -> type[DataKind]:
    """The kind that ``--data`` names."""
    return next(kind for kind in KINDS.items().values() if kind.matches(data))


def configure(options: Any) -> DataConfig:
    """The typed ``Config`` of ``options.data``'s kind, its defaults settled on ``options``;
    a data option that kind would ignore is refused, naming the kinds that take it."""
    kind = kind_of(options.data)
    takes = kind.takes()
    for name, given in KIND_OPTIONS.items():
        value = getattr(options, name)
        if given(value) and name not in takes:
            flag = "--" + name.replace("_", "-")
            shown = "" if isinstance(value, bool) else f" {value!r}"
            users = " or ".join(k.label for k in KINDS.items().values() if name in k.takes())
            raise ValueError(f"{flag}{shown} with --data {options.data}: it applies to {users} only, and "
                             f"would be ignored here; leave {flag} out (docs/data.md)")
    if options.val_data is not None and options.val_fraction is not None:
        raise ValueError(f"--val-fraction {options.val_fraction} with --val-data {options.val_data}: the "
                         "held-out images are that folder, nothing is split off; drop one of them")
    return kind.configure(options)


__all__ = ["KINDS", "DataConfig", "DataFacts", "DataKind", "configure", "kind_of"]
