"""A group's watcher thread: peers that die or abort.

The watcher selects on the tether (see ``_tether``: a peer's socket that ends without a
goodbye means its process died) and polls the store for a peer's abort notice and for a
peer's request for this rank's trail (see ``_trail``), until the teardown stops it. A peer
that died or aborted breaks the group (``_group_abort``).
"""

from __future__ import annotations

import logging
import selectors

from ._backends import read_notice
from ._group_abort import AbortingGroup
from ._group_state import WATCH_INTERVAL
from ._tether import GOODBYE
from ._trail import answer, asked

__all__ = ["WATCHER_NAME", "WatchingGroup"]

logger = logging.getLogger(__name__)

WATCHER_NAME = "lampdist-clique-watch"
"""The watcher thread's name, before ``-<rank>``."""


class WatchingGroup(AbortingGroup):
    """The group's watcher thread (see the module docstring)."""

    __slots__ = ()

    # -- peers that die or abort (the watcher thread) --------------------------------------

    def _watch(self) -> None:
        """Watch the tether for dead peers and the store for abort notices until stopped."""
        wake = self._wake_reader
        if wake is None:
            return
        selector = selectors.DefaultSelector()
        try:
            selector.register(wake, selectors.EVENT_READ, None)
            for peer, sock in self._tether.sockets.items():
                sock.setblocking(False)
                selector.register(sock, selectors.EVENT_READ, peer)
            gone_cleanly = self._gone_cleanly
            check_store = True
            answered: int | None = 0  # the peers' last request for this rank's trail answered
            while True:
                if self._wake_reader is None:  # released while it was in a store operation
                    return
                try:
                    events = selector.select(WATCH_INTERVAL)
                except (OSError, ValueError):  # the sockets were closed under it: released
                    return
                for key, _ in events:
                    if key.data is None:
                        return  # stopped
                    peer = key.data
                    sock = self._tether.sockets[peer]
                    try:
                        data = sock.recv(64)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if GOODBYE in data:
                        gone_cleanly.add(peer)
                    if not data:
                        selector.unregister(sock)
                        if peer not in gone_cleanly:
                            # A peer that aborted posted why before it closed: say that.
                            notice = self._link.read_notice() if check_store else None
                            if notice is not None and notice[0] != str(self.rank):
                                self._break(
                                    f"rank {notice[0]} left the clique: {notice[1]}", relay=False
                                )
                                return
                            # Rank 0 tells the others; a follower sees only rank 0's
                            # death, which every other rank sees for itself.
                            self._break(
                                f"rank {peer} is gone: its process died or it left the "
                                "clique without closing it",
                                relay=self.rank == 0,
                            )
                            return
                if self._link.lost:  # found gone (or stalled) on a failure path
                    answered, check_store = None, False
                if (answered is not None or check_store) and selector.select(0):
                    continue  # news from a peer came meanwhile: read it before the store
                if answered is not None:
                    answered = self._answer(answered)
                if check_store and not self._link.lost:
                    check_store = self._check_notice()
                    if self._failure is not None and self._pg is None:
                        return
        finally:
            selector.close()

    # -- the store's news ------------------------------------------------------------------

    def _answer(self, answered: int) -> int | None:
        """Post this rank's trail when a peer has asked for it since request ``answered``
        (see ``_trail``); the last request answered, or ``None`` once the store is gone."""
        try:
            request = asked(self._keys)
            if request > answered:
                with self._lock:
                    trail = self.trail.snapshot()
                answer(self._keys, self.rank, request, trail)
        except Exception as exc:  # the store is gone: nobody can ask any more
            self._link.lost = True
            logger.debug("rank %d: stop answering for the trail: %s", self.rank, exc)
            return None
        return request

    def _check_notice(self) -> bool:
        """Look for a peer's abort notice; False once the store need not be asked again."""
        try:
            notice = read_notice(self._keys)
        except Exception as exc:  # the store is gone: the tether still watches the peers
            self._link.lost = True
            logger.debug("rank %d: stop watching the store: %s", self.rank, exc)
            return False
        if notice is None:
            return True
        peer, reason = notice
        if peer != str(self.rank):
            self._break(f"rank {peer} left the clique: {reason}", relay=False)
        return False
