"""Things selectable by name: the one registry behind strategies, tasks, models and
reproductions.

Each registry holds what one option chooses from (``--strategy``, ``--task``,
``--model``, ``shmtrain reproduce NAME``): a name is registered once (a second item of the
same name is refused, naming the first), and an unknown name is refused naming the
option, the value and every name there is. Where the items live in modules that are
imported on demand, ``fill`` imports them before the first lookup.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Items of one kind by name.

    Args:
        what: the kind, as an error names it (``"strategy"``).
        option: the option that names an item (``"--strategy"``).
        hint: said after the list of names when a name is unknown (``", or module:callable"``).
        fill: imports the modules that register the items (called before every lookup,
            so it must be cheap after the first call).
    """

    def __init__(self, what: str, option: str, *, hint: str = "", fill: Callable[[], None] | None = None) -> None:
        self.what, self.option, self.hint = what, option, hint
        self._fill = fill
        self._items: dict[str, T] = {}

    def add(self, name: str, item: T) -> T:
        """Register ``item`` as ``name``; a name already taken is refused."""
        if not name:
            raise ValueError(f"{_label(item)} has no name")
        if name in self._items:
            raise ValueError(f"{self.what} name {name!r} is already registered by {_label(self._items[name])}")
        self._items[name] = item
        return item

    def remove(self, name: str) -> T:
        """Take ``name`` out again (a test's temporary item)."""
        return self._items.pop(name)

    def register(self, item: T) -> T:
        """Class decorator: register ``item`` under its ``name`` attribute."""
        return self.add(getattr(item, "name", ""), item)

    def get(self, name: str) -> T:
        """The item ``name``, or a ValueError naming the option and every name."""
        if self._fill is not None:
            self._fill()
        if name not in self._items:
            raise ValueError(f"{self.option} {name!r} is unknown; choose one of: {', '.join(sorted(self._items))}"
                             f"{self.hint}")
        return self._items[name]

    def items(self) -> dict[str, T]:
        """A copy of every item by name, in the order they were registered."""
        if self._fill is not None:
            self._fill()
        return dict(self._items)

    def names(self) -> list[str]:
        return list(self.items())

    def __contains__(self, name: object) -> bool:
        if self._fill is not None:
            self._fill()
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def _label(item: object) -> str:
    return getattr(item, "__qualname__", None) or type(item).__qualname__
