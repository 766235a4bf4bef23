"""Counts in messages: ``counted(1, "rank")`` is ``"1 rank"``, ``counted(2, "rank")`` is
``"2 ranks"``."""

from __future__ import annotations

__all__ = ["counted"]


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """``count`` and ``noun``, in the plural (``plural``, or ``noun`` + ``s``) unless
    ``count`` is 1."""
    if count == 1:
        return f"{count} {noun}"
    return f"{count} {plural if plural is not None else noun + 's'}"
