"""The state of one open clique's group: its fields, the thread that owns each, and the one
failure that every path shares.

The group's methods come in layers, each in a module that imports only the ones below it
(see ``_group``); this is the lowest. The threads that touch a group:

- the *setup thread*: the worker thread that runs ``Group.connect``; no other thread sees
  the group until it has started the watcher;
- the *event loop thread*: the parts of ``Group.aclose`` that do not block, and starts of
  collectives from async code;
- a *starting thread*: any thread that starts a collective (a rank's compute thread,
  autograd's thread for a gradient bucket, the event loop thread);
- the *issuing thread* (``lampdist-clique-issue-<rank>``): issues the collectives started on
  an event loop thread with NCCL (``_group_issue``);
- the *watcher thread* (``lampdist-clique-watch-<rank>``): the peers' tether and the store's
  notices and trail requests (``_group_watch``), and the break that follows (``_group_abort``);
- *torch's threads* (Gloo's workers, NCCL's watchdog, or the enqueuing thread inline): the
  completion callbacks of the pending collectives, which call ``_retire``, ``_fail`` and
  ``_translate``;
- a *failure-path thread*: any thread that aborts or abandons the clique, explains a failure
  seen outside it, accounts for a timeout, or ends a peer's process;
- the *teardown threads*: the worker threads of ``aclose``, one step after the other
  (``_announce_abort``, ``_shutdown``, ``_stop_threads``, ``_release``).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from typing import Any

import attrs
import torch

from ._bridge import Failure, PendingCollective
from ._sockets import TransportSockets
from ._store_link import StoreLink
from ._tether import Tether
from ._trail import Trail

__all__ = ["WATCH_INTERVAL", "GroupState"]

logger = logging.getLogger(__name__)

WATCH_INTERVAL = 0.05
"""How often the watcher polls the store for an abort notice."""


@attrs.define(eq=False)
class GroupState:
    """The fields of one open clique on one rank, by the thread that owns them (see the
    module docstring), and the failure they share."""

    # -- fixed when built: read from any thread --------------------------------------------

    rank: int
    nranks: int
    device: torch.device
    backend: str
    collective_timeout: float | None

    # -- the process group and the store: several threads, each under its own rule ---------

    _pg: Any = attrs.field(alias="pg", repr=False)
    """The torch process group; ``None`` once dropped. Under ``_pg_lock`` for the starting
    and issuing threads, which issue on it, and for the watcher (``_break``) and the
    teardown's ``_release``, which drop it. The NCCL abort and shutdown read it under
    ``_end_lock`` only: an enqueue blocked inside NCCL holds ``_pg_lock`` until the abort
    frees it. The watcher also reads it without a lock, to learn that it was dropped."""
    _store: Any = attrs.field(alias="store", repr=False)
    """The store's client, held so that its connection lives as long as the clique; no
    thread uses it; the teardown's ``_release`` drops it."""
    _keys: Any = attrs.field(alias="keys", repr=False)
    """The clique's keys in the store; read without a lock by the watcher, a timeout's
    account and ``end_process``; ``None`` once the teardown's ``_release`` dropped it."""
    _tether: Tether = attrs.field(alias="tether", repr=False)
    """The liveness sockets (see ``_tether``): the watcher thread's while it runs; the
    teardown's ``_release`` waits for the followers' goodbyes on them and closes them."""
    _link: StoreLink = attrs.field(alias="link", repr=False)
    """The store as the failure paths reach it (see ``_store_link``): any thread (it has a
    lock of its own; ``lost`` is a flag that any thread sets); ``_release`` drops its keys."""
    owns_default: bool = attrs.field(default=False, repr=False)
    """Whether this clique opened torch's default process group (and destroys it); fixed."""
    _sockets: TransportSockets = attrs.field(factory=TransportSockets, alias="sockets", repr=False)
    """Gloo: the connections of the groups, shut down to free their collectives on an abort
    (see ``_sockets``); under ``_sockets_lock``: any thread that ends them (an abort, the
    watcher's break), and ``_release``, which empties them before the groups are dropped."""

    # -- the locks -------------------------------------------------------------------------

    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)
    """The group's lock: the pending collectives, the failure, the closing flag, the order
    of issue (the hand-off and the inline issues) and the trail's collectives."""
    _pg_lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)
    """Guards ``_pg`` (see there)."""
    _sockets_lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)
    """Guards ``_sockets``."""
    _end_lock: threading.RLock = attrs.field(factory=threading.RLock, init=False, repr=False)
    """Guards the NCCL communicator's end: one abort or one shutdown, never both at once
    (the watcher may abort while the teardown shuts down)."""
    _asking: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)
    """Held by the one thread that asks the peers for their trails (see ``_account``)."""

    # -- under _lock: starting threads, torch's threads, the watcher, the teardown ---------

    _pending: set[PendingCollective] = attrs.field(factory=set, init=False, repr=False)
    """The collectives started and not retired: starting threads add, torch's threads
    retire (``_retire``), ``_fail`` fails them all, the teardown drains and empties it."""
    _failure: Failure | None = attrs.field(default=None, init=False, repr=False)
    """The clique's first failure, written once under ``_lock`` by whichever thread fails it
    (torch's, the watcher, a waiter whose deadline passed, an abort). Read under the lock,
    except by ``_enqueue`` (under ``_pg_lock``) and the watcher's loop: written once, so a
    read without the lock sees ``None`` or the failure."""
    _closing: bool = attrs.field(default=False, init=False, repr=False)
    """Set by ``aclose`` on the event loop thread; starting threads read it: no collective
    starts after it, and no thread is added to ``_threads``."""
    _threads: list[threading.Thread] = attrs.field(factory=list, init=False, repr=False)
    """The group's threads: the setup thread appends the watcher before the group is shared,
    a starting thread the issuer under ``_lock``; the teardown's ``_stop_threads`` joins
    and clears them once ``_closing`` is set."""
    _abandoned: bool = attrs.field(default=False, init=False)
    """Whether the teardown leaves the collectives in flight behind (``abandon``): set by a
    failure-path thread, read by ``aclose`` and ``_release``; a flag, without a lock."""

    # -- the issuing thread and its order (``_group_issue``) -------------------------------

    _queue: queue.SimpleQueue[Any] | None = attrs.field(default=None, init=False, repr=False)
    """The issuing thread's queue: created under ``_lock`` by the first starting thread that
    hands off, which also starts the thread; items and the teardown's stop sentinel are put
    under ``_lock``; the issuing thread takes them."""
    _hand_off: bool = attrs.field(default=False, init=False, repr=False)
    """Whether collectives started on an event loop thread go to the issuing thread (NCCL):
    fixed by the setup thread before the group is shared."""
    _handing_off: bool = attrs.field(default=False, init=False, repr=False)
    """Set under ``_lock`` once a collective went to the issuing thread: every later one
    follows it there. A starting thread reads it once without the lock first; a stale
    ``False`` is corrected under the lock."""
    _inline_issues: int = attrs.field(default=0, init=False, repr=False)
    """Under ``_lock``: inline issues decided and not finished yet (starting threads count
    themselves in and out); the issuing thread waits for them."""
    _inline_done: threading.Condition = attrs.field(init=False, repr=False)
    """Over ``_lock``: notified when ``_inline_issues`` falls to 0."""
    trail: Trail = attrs.field(factory=Trail, init=False, repr=False)
    """This rank's step and last collectives (see ``_trail``): collectives recorded and
    snapshots taken under ``_lock`` (starting threads; the watcher's answers, an account);
    the step and an entry's end are single stores from any thread."""

    # -- the watcher thread (``_group_watch``) ---------------------------------------------

    _wake_reader: socket.socket | None = attrs.field(default=None, init=False, repr=False)
    """The watcher selects on it: made by the setup thread before the watcher starts; the
    teardown's ``_release`` closes it and sets ``None``, which the watcher takes as released."""
    _wake_writer: socket.socket | None = attrs.field(default=None, init=False, repr=False)
    """Its other end: the teardown's ``_stop_threads`` writes to it to stop the watcher;
    ``_release`` closes it."""
    _gone_cleanly: set[int] = attrs.field(factory=set, init=False, repr=False)
    """The peers whose tether said goodbye: the watcher thread's; rank 0's ``_release``
    reads it after ``_stop_threads``."""

    # -- the failure paths and the teardown ------------------------------------------------

    _ended: bool = attrs.field(default=False, init=False, repr=False)
    """Under ``_end_lock``: whether the NCCL communicator was aborted (the watcher's break, an
    abort from any thread) or shut down (the teardown's ``_shutdown``)."""
    _account_text: str | None = attrs.field(default=None, init=False, repr=False)
    """Under ``_asking``: where the ranks were when a collective first timed out (see
    ``_account``), written by the first thread that asked, reused by the later ones."""
    _goodbye: bool = attrs.field(default=False, init=False, repr=False)
    """Whether this rank leaves cleanly: set by ``aclose`` on the event loop thread before
    its last teardown threads start (``_stop_threads``, ``_release``); ``_release`` reads it."""

    def __attrs_post_init__(self) -> None:
        self._inline_done = threading.Condition(self._lock)

    # -- what pending collectives call -----------------------------------------------------

    def _retire(self, pending: PendingCollective) -> None:
        with self._lock:
            self._pending.discard(pending)

    def _fail(self, failure: Failure) -> None:
        with self._lock:
            if self._failure is not None:
                return
            self._failure = failure
            pending = list(self._pending)
        logger.debug("rank %d: clique failed: %s", self.rank, failure[1])
        for each in pending:
            each._fail(failure)
