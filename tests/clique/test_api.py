"""``lampdist.clique`` keeps its ``__all__`` honest and documents every public name."""

from __future__ import annotations

import inspect

import lampdist.clique
from lampdist.clique import Clique, PendingCollective


def test_all_is_sorted_and_documented() -> None:
    assert lampdist.clique.__all__ == sorted(lampdist.clique.__all__)
    for name in lampdist.clique.__all__:
        assert getattr(lampdist.clique, name).__doc__, name


def test_public_methods_are_documented() -> None:
    for cls in (Clique, PendingCollective):
        for name, member in inspect.getmembers(cls, callable):
            if not name.startswith("_"):
                assert member.__doc__, f"{cls.__name__}.{name}"


def test_every_collective_has_a_start_form() -> None:
    for name in ("all_reduce", "broadcast", "reduce", "reduce_scatter", "all_gather"):
        assert inspect.iscoroutinefunction(getattr(Clique, name))
        assert not inspect.iscoroutinefunction(getattr(Clique, f"start_{name}"))
