"""Counts in messages: "1 rank", "2 ranks"."""

from __future__ import annotations

from lampdist._words import counted


def test_one_is_singular_and_every_other_count_plural() -> None:
    assert counted(1, "rank") == "1 rank"
    assert [counted(n, "rank") for n in (0, 2, 16)] == ["0 ranks", "2 ranks", "16 ranks"]
    assert counted(1, "sharded module") == "1 sharded module"
    assert counted(3, "child", "children") == "3 children"
    assert counted(1, "child", "children") == "1 child"
