"""One registry helper (``shmtrain/registry.py``) serves every option that names a thing."""

from __future__ import annotations

import pytest

from shmtrain.registry import Registry


def test_every_named_choice_is_one_registry() -> None:
    import shmtrain.strategies  # noqa: F401 - fills the strategies
    from shmtrain.models.registry import MODELS
    from shmtrain.reproduce.core import REPRODUCTIONS
    from shmtrain.runtime.data.kinds import KINDS
    from shmtrain.runtime.tasks.base import TASKS
    from shmtrain.strategies.base import STRATEGIES

    for registry in (STRATEGIES, TASKS, KINDS, REPRODUCTIONS, MODELS):
        assert isinstance(registry, Registry) and registry.names(), registry.what
    assert {"ssgd", "seasgd", "hsgd"} <= set(STRATEGIES)
    assert "classification" in TASKS and "smallcnn" in MODELS and "shmcaffe-table2" in REPRODUCTIONS
    assert list(KINDS)[-1] == "Folder"  # the kind that claims what is left is asked last


def test_a_name_is_taken_once_and_an_unknown_one_is_named_with_every_choice() -> None:
    class Thing:
        name = "a"

    things: Registry[type] = Registry("thing", "--thing", hint=", or module:callable")
    things.register(Thing)
    with pytest.raises(ValueError, match=r"thing name 'a' is already registered by .*Thing"):
        things.add("a", int)
    things.add("b", int)
    with pytest.raises(ValueError, match=r"^--thing 'c' is unknown; choose one of: a, b, or module:callable$"):
        things.get("c")
    assert things.get("b") is int and list(things) == ["a", "b"]
    assert things.remove("b") is int and "b" not in things


def test_fill_runs_before_a_lookup() -> None:
    calls = []

    def fill() -> None:  # imports the modules that register, once
        if not calls:
            calls.append(1)
            late.add("x", 1)

    late: Registry[int] = Registry("late", "--late", fill=fill)
    assert late.get("x") == 1 and late.names() == ["x"] and calls == [1]
