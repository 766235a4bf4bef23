"""Reaching a torch ``TCPStore`` in short attempts that the caller can interrupt, within a
:class:`Budget` of time."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import attrs
from torch._C._distributed_c10d import TCPStore

__all__ = ["NO_LIMIT", "POLL", "Budget", "connect_store", "wait_for_keys"]

logger = logging.getLogger(__name__)

POLL = 0.05  # seconds between two looks at a store, or two attempts to reach it
_CONNECT_SLICE = timedelta(seconds=2)  # the longest single attempt
NO_LIMIT = timedelta(days=365)
"""What a budget of ``None`` (no limit) gives as the time left, and torch gets for it."""


def _never() -> None:
    """A ``check_cancelled`` for waits that cannot be cancelled."""


@attrs.define(eq=False)
class Budget:
    """A blocking wait's time, counted from the budget's creation: :meth:`remaining` is the
    ``remaining`` callable of :func:`connect_store` and :func:`wait_for_keys`.

    ``seconds`` is the budget (``None``: no limit); ``expired`` makes the error raised once it
    is spent; ``check_cancelled`` (``anyio.from_thread.check_cancelled`` in a worker thread)
    is called first on every look, so a cancelled caller stops within one slice.
    """

    seconds: float | None
    expired: Callable[[], BaseException]
    check_cancelled: Callable[[], None] = _never
    start: float = attrs.field(factory=time.monotonic)

    def remaining(self) -> timedelta:
        """The time left (:data:`NO_LIMIT` without a limit); raises the caller's cancellation,
        or ``expired()`` once the budget is spent."""
        self.check_cancelled()
        if self.seconds is None:
            return NO_LIMIT
        left = self.start + self.seconds - time.monotonic()
        if left <= 0:
            raise self.expired()
        return timedelta(seconds=left)


def connect_store(host: str, port: int, remaining: Callable[[], timedelta]) -> Any:
    """A client of the store at ``host:port``, whose timeout is then ``remaining()``.

    ``remaining`` gives the time left and raises when it is spent (or when the caller was
    cancelled); it is called before every attempt. Each attempt gets at most 2 s: torch's own
    connect loop cannot be interrupted, and a store that accepts and then drops connections
    (its process dying just then) would keep it retrying for the whole budget, deaf to
    cancellation.
    """
    while True:
        attempt = min(remaining(), _CONNECT_SLICE)
        try:
            socket.create_connection((host, port), timeout=attempt.total_seconds()).close()
            store = TCPStore(host, port, None, False, timeout=attempt, wait_for_workers=False)
        except (OSError, RuntimeError) as exc:  # torch's DistNetworkError is a RuntimeError
            logger.debug("store %s:%d not reachable: %s", host, port, exc)
            time.sleep(POLL)
            continue
        store.set_timeout(remaining())
        return store


def wait_for_keys(store: Any, names: list[str], remaining: Callable[[], timedelta]) -> None:
    """Wait until every key of ``names`` exists in ``store``, looking every ``POLL`` seconds;
    ``remaining`` is called between looks and raises when the time is spent or the caller was
    cancelled."""
    while not store.check(names):
        remaining()
        time.sleep(POLL)
