"""The clique's store once the clique is open, as its failure paths use it.

After setup the store carries little: abort notices (``_backends``) and the trail requests
of a timeout's account (``_trail``). It is served by the root's process, so a failure path
must expect it gone (the root died: torch logs every failed store call at length, with C++
frames) or stalled (the root stopped: a store call then waits on its socket, with no
deadline of its own). So the failure paths ask it through :class:`StoreLink`: each call first
checks that the store's port still takes connections (a plain socket: no store call, no
log), then runs in a thread of its own for at most :data:`STORE_WAIT` seconds. Once a call
failed or did not answer, the store counts as lost and is not asked again.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import attrs

from ._backends import post_notice, read_notice

__all__ = ["STORE_WAIT", "StoreLink"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

STORE_WAIT = 1.0
"""How long a failure path waits for one store operation (or to reach the store's port)."""


@attrs.define(eq=False)
class StoreLink:
    """One rank's way to the clique's store on its failure paths (see the module docstring).
    Callable from any thread."""

    rank: int
    keys: Any = attrs.field(repr=False)
    """The clique's keys in the store; ``None`` once the clique is released."""
    address: tuple[str, int]
    """Where the store listens."""
    lost: bool = False
    """Whether the store was found gone or stalled: it is not asked again. The watcher
    thread sets it too when its own polls fail."""
    _noticed: bool = attrs.field(default=False, init=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)

    def read_notice(self) -> tuple[str, str] | None:
        """A rank's abort notice (its rank as text, its reason), or ``None`` when there is
        none or the store is lost."""
        return self.bounded(read_notice, None)

    def post_notice(self, reason: str) -> None:
        """Post this rank's abort notice, once: the first reason is the cause."""
        with self._lock:
            if self._noticed:
                return
            self._noticed = True
        self.bounded(partial(post_notice, rank=self.rank, reason=reason), None)

    def bounded(self, operation: Callable[[Any], T], default: T) -> T:
        """``operation(keys)`` within :data:`STORE_WAIT` seconds, or ``default`` when the
        store is lost, fails or does not answer in time (the thread left waiting on a stalled
        store is a daemon; it ends with the store's socket)."""
        keys = self.keys
        if keys is None or self.lost or not self._listens():
            return default
        outcome: list[T] = []

        def call() -> None:
            try:
                outcome.append(operation(keys))
            except Exception as exc:  # once is enough: torch logs every failure at length
                self.lost = True
                logger.debug("rank %d: the clique's store failed: %s", self.rank, exc)

        thread = threading.Thread(target=call, daemon=True, name=f"lampdist-store-{self.rank}")
        thread.start()
        thread.join(STORE_WAIT)
        if thread.is_alive():
            self.lost = True
            logger.debug("rank %d: the clique's store does not answer", self.rank)
        return outcome[0] if outcome else default

    def _listens(self) -> bool:
        try:
            socket.create_connection(self.address, timeout=STORE_WAIT).close()
        except OSError:
            self.lost = True
            logger.debug("rank %d: the clique's store is gone", self.rank)
            return False
        return True
