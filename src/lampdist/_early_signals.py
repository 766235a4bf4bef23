"""The signals that stop a run, and those noted before a run handled them (no torch here:
a command notes them before it imports torch)."""

from __future__ import annotations

import signal
from collections.abc import Callable

__all__ = ["STOP_SIGNALS", "note_signals_early", "take_early_signals"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""The signals that stop a run gracefully."""

_EARLY: list[int] = []
"""Signals noted before any run handled them (see :func:`note_signals_early`)."""


def note_signals_early() -> Callable[[], None]:
    """Note SIGTERM and SIGINT from now on, until a run handles them itself (they are then
    its first signals, acted on at once): for a command whose set-up (imports, arguments)
    comes before its run. Returns the function that puts the previous handlers back. Call
    it from the main thread."""
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}

    def note(signum: int, frame: object) -> None:
        _EARLY.append(signum)

    for signum in STOP_SIGNALS:
        signal.signal(signum, note)

    def restore() -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    return restore


def take_early_signals() -> list[int]:
    """The signals noted so far (and forget them): a run that begins to handle signals takes
    them as received."""
    taken = _EARLY[:]
    _EARLY.clear()
    return taken
