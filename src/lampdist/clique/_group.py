"""The live state of one open clique: enqueue, failure, peers that die or abort, teardown.

One :class:`Group` per open clique. It owns the torch process group (never the default
group), one TCPStore client, the liveness tether to rank 0 (see ``_tether``), a watcher
thread that selects on the tether and polls the store for abort notices and for a peer's
request for this rank's trail (see ``_trail``), and on NCCL an enqueue thread. Everything
blocking runs in worker threads; everything it holds is dropped on close, so no group or
work object outlives the clique.
"""

from __future__ import annotations

import gc
import logging
import queue
import selectors
import socket
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import anyio
import anyio.to_thread
import attrs
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore

from .._clique_id import CliqueId
from .._errors import CliqueError, CliqueTimeout, Collective, CollectiveFailed, LampdistError, Phase
from .._store import connect_store
from ._backends import (
    SETUP,
    Setup,
    make_gloo,
    make_nccl,
    read_notice,
    span,
    translate,
)
from ._backends import describe as _describe
from ._bridge import Failure, PendingCollective, on_event_loop_thread
from ._process import end_if_local, identity
from ._sockets import TransportSockets, noting_sockets
from ._store_link import StoreLink
from ._tether import GOODBYE, Tether
from ._trail import ANSWER_WAIT, Trail, account, answer, ask, asked

__all__ = ["Group", "Issue"]

logger = logging.getLogger(__name__)


# Enqueues the collective's works on the process group, appending each to the list.
Issue = Callable[[Any, list[Any]], None]

_TEARDOWN: Phase = "clique teardown"
# Store operations after setup (abort notices, trails): small, so a short deadline, which
# bounds how long an abort waits on a store whose host stalled (the root's process).
_STORE_OP_TIMEOUT = timedelta(seconds=2)
# How long the teardown waits for the watcher thread, which may be inside a store operation
# on a stalled store (it is a daemon: left behind, it ends with its socket).
_WATCHER_JOIN = 2.0
_WATCHER_NAME = "lampdist-clique-watch"
# How long rank 0, leaving cleanly, waits for the followers to release their cliques before
# it closes (and its rendezvous the store) behind them (see Tether.await_goodbyes).
_GOODBYE_WAIT = 2.0
_WATCH_INTERVAL = 0.05  # how often the watcher polls the store for an abort notice
# How long explain() waits for the watcher to learn of a peer's death or abort notice: a few
# of its polls (only on the failure path of a collective run outside the clique).
_EXPLAIN_WAIT = 4 * _WATCH_INTERVAL
_DRAIN_NO_LIMIT = 600.0  # how long close waits for pending work when collective_timeout is None
# NCCL groups of one process are shut down and destroyed one at a time: one group's shutdown
# beside another's destruction can crash the process (docs/reliability.md, Limits).
_NCCL_TEARDOWN = threading.Lock()
# How long the teardown waits for torch to destroy a process group (or for the lock above)
# before it leaves the group behind: a destructor may never return, and the clique's exit
# must not wait for it forever (docs/reliability.md, Limits).
_RELEASE_LIMIT = 60.0
_ABANDON_LIMIT = 1.0  # the same for a clique abandoned (Clique.abandon): a stalled peer


@attrs.define(eq=False)
class Group:
    """The live state of one open clique on one rank (see the module docstring)."""

    rank: int
    nranks: int
    device: torch.device
    backend: str
    collective_timeout: float | None
    _pg: Any = attrs.field(alias="pg", repr=False)
    _store: Any = attrs.field(alias="store", repr=False)
    _keys: Any = attrs.field(alias="keys", repr=False)
    _tether: Tether = attrs.field(alias="tether", repr=False)
    _link: StoreLink = attrs.field(alias="link", repr=False)
    """The store as the failure paths reach it (see ``_store_link``)."""
    owns_default: bool = attrs.field(default=False, repr=False)
    """Whether this clique opened torch's default process group (and destroys it)."""
    _sockets: TransportSockets = attrs.field(factory=TransportSockets, alias="sockets", repr=False)
    """Gloo: the connections of the groups, shut down to free their collectives on an abort
    (see ``_sockets``); emptied, under ``_sockets_lock``, before the groups are dropped."""
    _sockets_lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)
    _pg_lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)
    _pending: set[PendingCollective] = attrs.field(factory=set, init=False, repr=False)
    _failure: Failure | None = attrs.field(default=None, init=False, repr=False)
    _closing: bool = attrs.field(default=False, init=False, repr=False)
    _threads: list[threading.Thread] = attrs.field(factory=list, init=False, repr=False)
    _abandoned: bool = attrs.field(default=False, init=False)
    """Whether the teardown leaves the collectives in flight behind (:meth:`abandon`)."""
    _queue: queue.SimpleQueue[Any] | None = attrs.field(default=None, init=False, repr=False)
    _wake_reader: socket.socket | None = attrs.field(default=None, init=False, repr=False)
    _wake_writer: socket.socket | None = attrs.field(default=None, init=False, repr=False)
    _goodbye: bool = attrs.field(default=False, init=False, repr=False)
    # The peers whose tether said goodbye (the watcher thread's, read after it is joined).
    _gone_cleanly: set[int] = attrs.field(factory=set, init=False, repr=False)
    # Whether collectives started on an event loop thread go to the issuing thread (NCCL).
    _hand_off: bool = attrs.field(default=False, init=False, repr=False)
    # Set once a collective went to the issuing thread: every later one follows it there.
    _handing_off: bool = attrs.field(default=False, init=False, repr=False)
    # Inline issues decided and not finished yet; the issuing thread waits for them.
    _inline_issues: int = attrs.field(default=0, init=False, repr=False)
    _inline_done: threading.Condition = attrs.field(init=False, repr=False)
    trail: Trail = attrs.field(factory=Trail, init=False, repr=False)
    """This rank's step and last collectives (see ``_trail``); collectives recorded under
    ``_lock``."""
    # Where the ranks were when a collective first timed out (see _account), under _asking.
    _account_text: str | None = attrs.field(default=None, init=False, repr=False)
    _asking: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self._inline_done = threading.Condition(self._lock)

    # Guards the NCCL communicator's end: one abort or one shutdown, never both at once
    # (the watcher may abort while the teardown shuts down).
    _end_lock: threading.RLock = attrs.field(factory=threading.RLock, init=False, repr=False)
    _ended: bool = attrs.field(default=False, init=False, repr=False)

    # -- setup ---------------------------------------------------------------------------

    @classmethod
    def connect(
        cls,
        *,
        clique_id: CliqueId,
        rank: int,
        device: torch.device,
        setup_timeout: float | None,
        collective_timeout: float | None,
        threaded: bool,
        default_group: bool = False,
        check_cancelled: Callable[[], None] = lambda: None,
    ) -> Group:
        """Build the process group (blocking: run it in a worker thread).

        Every wait until all ranks are known to be ready is a loop of short slices that calls
        ``check_cancelled`` (``anyio.from_thread.check_cancelled``) and looks for a peer's
        abort notice. Raises :class:`CliqueTimeout` when the peers do not all arrive within
        ``setup_timeout``, :class:`CollectiveFailed` when a peer abandoned the setup, and
        :class:`CliqueError` on any other setup failure.

        With ``default_group``, torch's default process group is opened next, from the same
        store and within the same deadline (see :func:`open_default_group`).
        """
        backend = "nccl" if device.type == "cuda" else "gloo"
        setup = Setup.start(rank, setup_timeout, check_cancelled)
        op_timeout = span(collective_timeout)
        store: Any = None
        keys: Any = None
        pg: Any = None
        base: Any = None
        pg_store: Any = None
        tether: Tether | None = None
        noted: list[TransportSockets] = []
        try:
            store = connect_store(clique_id.host, clique_id.port, setup.remaining)
            base = PrefixStore(clique_id.prefix, store)
            generation = base.add(f"generation/{rank}", 1)  # several openings of one id
            keys = PrefixStore(f"open/{generation}", base)
            setup.keys = keys
            pg_store = PrefixStore("pg", keys)
            name = f"lampdist-{clique_id.prefix[:8]}-{generation}"
            tether = Tether.connect(
                keys=keys,
                rank=rank,
                nranks=clique_id.nranks,
                host=clique_id.host,
                port=clique_id.port,
                remaining=setup.remaining,
            )
            keys.set(f"process/{rank}", identity())  # see end_process
            # Every rank alive and tied to rank 0 before the process group's own setup,
            # which cannot be interrupted, starts.
            keys.set(f"ready/{rank}", "1")
            setup.wait_for(keys, [f"ready/{peer}" for peer in range(clique_id.nranks)])
            # Gloo's connections, noted for an abort (NCCL has an abort of its own).
            with noting_sockets(noted.append) if backend == "gloo" else nullcontext():
                if backend == "gloo":
                    pg = make_gloo(
                        store=pg_store,
                        host=clique_id.host,
                        rank=rank,
                        nranks=clique_id.nranks,
                        name=name,
                        budget=setup.budget,
                        op_timeout=op_timeout,
                    )
                else:
                    pg = make_nccl(
                        store=pg_store,
                        rank=rank,
                        nranks=clique_id.nranks,
                        name=name,
                        device=device,
                        op_timeout=op_timeout,
                    )
                if default_group:
                    open_default_group(
                        store=PrefixStore("default", keys),
                        backend=backend,
                        rank=rank,
                        nranks=clique_id.nranks,
                        device=device,
                        timeout=op_timeout,
                    )
            store.set_timeout(_STORE_OP_TIMEOUT)
            group = cls(
                rank=rank,
                nranks=clique_id.nranks,
                device=device,
                backend=backend,
                collective_timeout=collective_timeout,
                pg=pg,
                store=store,
                keys=keys,
                tether=tether,
                owns_default=default_group,
                sockets=noted[0] if noted else TransportSockets(),
                link=StoreLink(rank, keys, (clique_id.host, clique_id.port)),
            )
        except BaseException as exc:
            if default_group and dist.is_initialized() and not isinstance(exc, _Occupied):
                dist.destroy_process_group()
            setup.abandon(exc)
            setup.keys = None
            # Drop every partial object here, before the error travels with our frame.
            if tether is not None:
                tether.close(goodbye=False)
            store = keys = pg = base = pg_store = tether = None
            traceback.clear_frames(exc.__traceback__)  # the frames below still hold stores
            gc.collect()
            if isinstance(exc, LampdistError) or not isinstance(exc, Exception):
                raise
            kind, message = translate(exc, SETUP)
            raise kind(message, rank=rank, phase=SETUP) from exc
        group._start_threads(threaded or backend == "nccl")
        logger.debug("rank %d: %s clique %s open", rank, backend, name)
        return group

    def _start_threads(self, threaded: bool) -> None:
        self._wake_reader, self._wake_writer = socket.socketpair()
        watcher = threading.Thread(
            target=self._watch, daemon=True, name=f"{_WATCHER_NAME}-{self.rank}"
        )
        self._threads.append(watcher)
        self._hand_off = threaded
        watcher.start()

    # -- collectives ---------------------------------------------------------------------

    def start(
        self, name: Collective, issue: Issue, *, nbytes: int = 0, wait_for_device: bool = False
    ) -> PendingCollective:
        """Start a collective from any thread; raise at once if the clique is closed or broken.

        ``nbytes``, the size of the tensors it moves, goes into the rank's trail with the
        collective's number, for the account of a timeout.

        The calling thread issues it (a rank's compute thread, autograd's thread for a
        gradient bucket), except on an event loop thread with NCCL: an NCCL call can wait on
        the CUDA driver (for a GPU that another rank of the process keeps busy), which must
        not stall the loop, so the issuing thread does it there. Collectives are issued in
        the order their starts took ``_lock``: once one went to the issuing thread, every
        later one goes there too, and the issuing thread waits for the inline issues decided
        before it (``_inline_issues``).
        """
        pending = PendingCollective(
            name=name, rank=self.rank, owner=self, timeout=self.collective_timeout
        )
        hand_off = self._hand_off and (self._handing_off or on_event_loop_thread())
        # The caller's stream: the collective must see the work queued on it before this
        # call (the issuing thread's own current stream is another one).
        stream = None
        if self.device.type == "cuda" and (hand_off or wait_for_device):
            stream = torch.cuda.current_stream(self.device)
        with self._lock:
            if self._closing:
                raise CliqueError(
                    "the clique is closed; open a new one", rank=self.rank, phase=name
                )
            failure = self._failure
            if failure is None:
                self._pending.add(pending)
                pending._entry = self.trail.start(name, nbytes, pending._started)
                hand_off = hand_off or self._handing_off
                if hand_off:  # under the lock: never behind the stop sentinel
                    self._handing_off = True
                    self._issuing_queue().put((pending, issue, stream, wait_for_device))
                else:
                    self._inline_issues += 1
        if failure is not None:
            kind, message = failure
            raise kind(message, rank=self.rank, phase=name)
        if not hand_off:
            try:
                self._enqueue(pending, issue, stream, wait_for_device)
            finally:
                with self._lock:
                    self._inline_issues -= 1
                    if not self._inline_issues:
                        self._inline_done.notify_all()
        return pending

    def _issuing_queue(self) -> queue.SimpleQueue[Any]:
        """The issuing thread's queue, starting the thread on first use (under the lock)."""
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            issuer = threading.Thread(
                target=self._run_issuer, daemon=True, name=f"lampdist-clique-issue-{self.rank}"
            )
            self._threads.append(issuer)
            issuer.start()
        return self._queue

    def _run_issuer(self) -> None:
        # One thread per rank, so several ranks of one process never share it.
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        items = self._queue
        if items is None:  # set before this thread starts
            return
        while (item := items.get()) is not None:
            with self._lock:  # inline issues decided before this item came first
                while self._inline_issues:
                    self._inline_done.wait()
            self._enqueue(*item)
            del item

    def _enqueue(
        self, pending: PendingCollective, issue: Issue, stream: Any, wait_for_device: bool
    ) -> None:
        works: list[Any] = []
        failure: Failure | None = None
        device_event = None
        with self._pg_lock:
            pg = self._pg
            try:
                if pg is None:
                    failure = self._failure or (CollectiveFailed, "the clique was torn down")
                elif stream is not None:
                    with torch.cuda.stream(stream):
                        issue(pg, works)
                        if wait_for_device:
                            for work in works:
                                work.wait()  # the caller's stream waits for the collective
                            device_event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch
                            device_event.record(stream)
                else:
                    issue(pg, works)
            except Exception as exc:
                failure = translate(exc, pending.name)
            finally:
                del pg  # the group's last reference must never be a thread's local
        pending._attach(
            works,
            track_device=self.backend == "nccl",
            device_event=device_event,
            failure=failure,
        )

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

    def _translate(self, exc: BaseException, phase: Phase, what: str | None = None) -> Failure:
        """``exc`` as a failure of collective ``phase`` (``what`` names it with its number
        and size in a timeout's message)."""
        kind, message = translate(exc, phase)
        if isinstance(exc, LampdistError):
            return kind, message
        # A peer that leaves abnormally posts its notice before its sockets close: name it.
        notice = self._link.read_notice()
        if notice is not None and notice[0] != str(self.rank):
            return CollectiveFailed, f"{phase} failed: rank {notice[0]} left the clique: " + (
                f"{notice[1]} ({message.removeprefix(f'{phase} failed: ')})"
            )
        if kind is CliqueTimeout:
            # The backend's own deadline is the clique's: say which limit passed, as the
            # clique's timer does when it fires first.
            detail = message.removeprefix(f"{phase} failed: ")
            limit = self.collective_timeout
            what = what or phase
            return kind, f"{what} did not complete within collective_timeout={limit} s ({detail})"
        return kind, message

    def _account(self, failure: Failure) -> Failure:
        """A timeout's ``failure`` with where every rank is: its step, its last collectives,
        how long it has waited in its current one (see ``_trail``). Blocking: the first
        caller asks the peers and waits up to :data:`ANSWER_WAIT` seconds for their answers;
        later callers reuse its account. Other failures are returned as they are."""
        kind, message = failure
        if kind is not CliqueTimeout:
            return failure
        if not self._asking.acquire(timeout=2 * ANSWER_WAIT):  # another caller is asking
            return failure
        try:
            if self._account_text is None:
                with self._lock:
                    trails = {self.rank: self.trail.snapshot()}
                keys = self._keys
                if keys is not None and self.nranks > 1:
                    trails.update(ask(keys, self.rank, self.nranks, ANSWER_WAIT))
                self._account_text = account(trails, self.rank, self.nranks, ANSWER_WAIT)
            text = self._account_text
        finally:
            self._asking.release()
        return kind, f"{message.rstrip('.')}. {text}"

    def explain(self, exc: BaseException, phase: Phase) -> Failure | None:
        """What this clique knows of ``exc``, a failure seen outside it (in a collective of
        torch's default group, say): its own failure, or a peer's abort notice naming the
        peer that left (a timeout says where every rank is, see :meth:`_account`); ``None``
        when it knows of none. A peer's death can reach the caller's
        collective before the watcher reads the tether: give the watcher
        :data:`_EXPLAIN_WAIT` seconds to learn of it."""
        deadline = time.monotonic() + _EXPLAIN_WAIT
        while True:
            with self._lock:
                failure = self._failure
            if failure is not None or time.monotonic() >= deadline:
                break
            time.sleep(_WATCH_INTERVAL / 5)
        if failure is not None:
            kind, message = failure
            return self._account((kind, f"{message} ({type(exc).__name__}: {exc})"))
        notice = self._link.read_notice()
        if notice is not None and notice[0] != str(self.rank):
            return CollectiveFailed, (
                f"{phase} failed: rank {notice[0]} left the clique: {notice[1]} "
                f"({type(exc).__name__}: {exc})"
            )
        if _from_a_backend(exc):  # a collective of another group of this process failed
            kind, message = translate(exc, phase)
            if kind is CliqueTimeout:
                detail = message.removeprefix(f"{phase} failed: ")
                limit = self.collective_timeout
                message = f"{phase} did not complete within collective_timeout={limit} s ({detail})"
            return self._account((kind, message))
        return None

    # -- peers that die or abort ----------------------------------------------------------

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
                    events = selector.select(_WATCH_INTERVAL)
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

    def _break(self, message: str, *, relay: bool) -> None:
        """A peer died or aborted: fail everything here, tell the others, drop the group."""
        self._fail((CollectiveFailed, message))
        if relay:
            self._link.post_notice(message)
        self._abort_nccl()
        self._end_connections()
        with self._pg_lock:
            pg, self._pg = self._pg, None
        # Gloo: dropping the group closes its sockets, so peers blocked on us fail at once.
        del pg

    def _abort_nccl(self) -> None:
        """Abort the NCCL communicator: its kernels stop and the enqueue thread unblocks.

        Deliberately without the group lock: an enqueue blocked inside NCCL holds it, and
        only the abort can set it free. Once only, and never beside a shutdown: the watcher (a
        peer died) and the teardown may both ask, from different threads.
        """
        if self.backend != "nccl":
            return
        with self._end_lock:
            if self._ended:
                return
            self._ended = True
            pg = self._pg
            try:
                if pg is not None:
                    pg.abort()
                if self.owns_default and dist.is_initialized():
                    dist.distributed_c10d._abort_process_group()
            except Exception:
                logger.exception("rank %d: aborting the NCCL communicator failed", self.rank)
            finally:
                del pg

    def abandon(self, reason: str) -> None:
        """Abort (see :meth:`_announce_abort`), and have the teardown leave the collectives
        in flight behind rather than wait for them: a stalled peer may hold them until they
        time out."""
        self._abandoned = True
        self._announce_abort(reason)

    def _announce_abort(self, reason: str) -> None:
        self._fail((CollectiveFailed, f"the clique was torn down on rank {self.rank}: {reason}"))
        self._link.post_notice(reason)
        self._abort_nccl()
        self._end_connections()

    def _end_connections(self) -> None:
        """Gloo: shut this rank's connections down, so that its collectives in flight fail at
        once here and at the other end, a stalled peer included (see ``_sockets``). After the
        notice is posted: a peer whose collective fails then reads it and names this rank."""
        with self._sockets_lock:
            ended = self._sockets.shut_down()
        if ended:
            logger.debug("rank %d: shut down %d Gloo connections", self.rank, ended)

    def end_process(self, peer: int) -> int | None:
        """SIGKILL rank ``peer``'s process if it runs on this machine (see ``_process``); its
        PID, or ``None``. Blocking (a store read): run it in a worker thread."""
        keys = self._keys
        try:
            noted = "" if keys is None else keys.get(f"process/{peer}").decode()
        except Exception as exc:  # the store is gone or the key never came
            logger.debug("rank %d: no process noted for rank %d: %s", self.rank, peer, exc)
            return None
        return end_if_local(noted)

    # -- teardown ------------------------------------------------------------------------

    async def aclose(
        self, exc: BaseException | None, *, limiter: anyio.CapacityLimiter | None
    ) -> None:
        """Tear down on every path; raise :class:`CliqueTimeout` only for a clean exit whose
        started collectives did not finish."""
        with anyio.CancelScope(shield=True):
            with self._lock:
                self._closing = True
                failure = self._failure
            abnormal = exc is not None or failure is not None
            if abnormal:
                reason = _describe(exc) if exc is not None else (failure or ("", ""))[1]
                await anyio.to_thread.run_sync(self._announce_abort, reason, limiter=limiter)
            # After an abort NCCL's kernels are gone and their completions may never be
            # reported; Gloo's works end once the peers, told above, close their sockets.
            drained = (
                (abnormal and self.backend == "nccl") or self._abandoned or await self._drain()
            )
            if not drained and not abnormal:
                abnormal = True
                await anyio.to_thread.run_sync(
                    self._announce_abort, "started collectives did not finish", limiter=limiter
                )
            if not abnormal and self.backend == "nccl":
                await anyio.to_thread.run_sync(self._shutdown, limiter=limiter)
            self._goodbye = not abnormal
            await anyio.to_thread.run_sync(self._stop_threads, limiter=limiter)
            await anyio.to_thread.run_sync(self._release, limiter=limiter)
        if not drained and exc is None:
            raise CliqueTimeout(
                f"started collectives did not finish within {self._drain_timeout()} s of "
                "closing the clique; await every collective before leaving the clique",
                rank=self.rank,
                phase=_TEARDOWN,
            )

    def _drain_timeout(self) -> float:
        return _DRAIN_NO_LIMIT if self.collective_timeout is None else self.collective_timeout

    async def _drain(self) -> bool:
        with anyio.move_on_after(self._drain_timeout()):
            while True:
                with self._lock:
                    pending = next(iter(self._pending), None)
                if pending is None:
                    return True
                await pending._final.wait()
                self._retire(pending)
        return False

    def _shutdown(self) -> None:
        """NCCL after a clean exit: flush and destroy the communicator (abort if that fails)."""
        with self._end_lock:
            if self._ended:  # the watcher aborted it meanwhile
                return
            pg = self._pg
            try:
                if pg is not None:
                    if not _NCCL_TEARDOWN.acquire(timeout=_RELEASE_LIMIT):
                        logger.error(
                            "rank %d: %s: another clique's NCCL teardown has not finished in "
                            "%g s; aborting this communicator instead of shutting it down",
                            self.rank,
                            _TEARDOWN,
                            _RELEASE_LIMIT,
                        )
                        self._abort_nccl()
                        return
                    try:
                        pg.shutdown()
                    finally:
                        _NCCL_TEARDOWN.release()
                self._ended = True
            except Exception:
                logger.exception("rank %d: NCCL shutdown failed; aborting", self.rank)
                self._abort_nccl()
            finally:
                del pg

    def _stop_threads(self) -> None:
        if self._wake_writer is not None:
            self._wake_writer.send(b"x")
        if self._queue is not None:
            with self._lock:
                self._queue.put(None)
        for thread in self._threads:
            watcher = thread.name.startswith(_WATCHER_NAME)
            # Not at all once the store stalled: the watcher may be waiting on it.
            thread.join((0.0 if self._link.lost else _WATCHER_JOIN) if watcher else None)
            if thread.is_alive():  # inside a store operation on a stalled store
                logger.debug("rank %d: left the watcher thread to end by itself", self.rank)
        self._threads.clear()

    def _release(self) -> None:
        with self._sockets_lock:  # Gloo closes them once the group is gone
            self._sockets = TransportSockets()
        with self._pg_lock:
            pg, self._pg = self._pg, None
        with self._lock:
            pending, self._pending = list(self._pending), set()
        for each in pending:
            each._release()
        # Gloo joins its worker threads here, after any stuck work has failed or timed out.
        last = [pg, pending]
        del pg, pending
        drop_within(
            last,
            _ABANDON_LIMIT if self._abandoned else _RELEASE_LIMIT,
            lock=_NCCL_TEARDOWN if self.backend == "nccl" else None,
            rank=self.rank,
            abandoned=self._abandoned,
        )
        if self.owns_default and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                logger.exception("rank %d: destroying the default process group failed", self.rank)
        if self._goodbye and self.rank == 0:
            self._tether.await_goodbyes(self._gone_cleanly, _GOODBYE_WAIT)
        self._tether.close(goodbye=self._goodbye)
        for end in (self._wake_reader, self._wake_writer):
            if end is not None:
                end.close()
        self._wake_reader = self._wake_writer = None
        self._keys = self._store = self._link.keys = None
        if not self._goodbye:
            # Every reference above is dropped by reference counting; after a failure, also
            # collect the cycles that tracebacks form, in case one of them reaches a work.
            gc.collect()


def _from_a_backend(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective backend's own error (torch's distributed errors, or
    Gloo's and NCCL's runtime errors, which name their sources), not a model's."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("gloo/" in text or "NCCL" in text)


class _Occupied(CliqueError):
    """The process has a default process group already (not ours to destroy)."""


def open_default_group(
    *, store: Any, backend: str, rank: int, nranks: int, device: torch.device, timeout: timedelta
) -> None:
    """Open torch's default process group over ``store``, whose collectives time out after
    ``timeout`` as the clique's do. Raises :class:`CliqueError` when the process has one: torch
    allows one per process, so one rank per process."""
    if dist.is_initialized():
        raise _Occupied(
            "this process already has torch's default process group; step_on='fsdp' needs "
            "one rank per process, and the process group to itself",
            rank=rank,
            phase=SETUP,
        )
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=rank,
        world_size=nranks,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )


def drop_within(
    last: list[Any],
    limit: float,
    *,
    lock: threading.Lock | None,
    rank: int,
    abandoned: bool = False,
) -> bool:
    """Empty ``last``, the only references to a process group and its works, in a thread of
    its own (under ``lock`` when given) and wait up to ``limit`` seconds for it.

    Returns whether the references were dropped in time. A destructor that does not return
    is left behind in that daemon thread with an error logged, so the clique's exit (and the
    error it may carry) does not wait for it forever; the process then waits for that thread
    when it exits, before the interpreter shuts down (``_preload.await_own_threads``): a
    group destroyed while the interpreter shuts down aborts the process.
    """

    def drop() -> None:
        with lock or nullcontext():
            last.clear()

    thread = threading.Thread(target=drop, daemon=True, name=f"lampdist-clique-drop-{rank}")
    thread.start()
    thread.join(limit)
    if not thread.is_alive():
        return True
    from .._preload import register_exit_hook  # the teardown's one tie to the process's exit

    register_exit_hook()
    if abandoned:
        logger.info(
            "rank %d: %s: the abandoned process group ends in the background once its "
            "collectives in flight fail or time out",
            rank,
            _TEARDOWN,
        )
        return False
    logger.error(
        "rank %d: %s: the process group was not destroyed within %g s; leaving it behind "
        "(its threads and device memory stay until the process exits)",
        rank,
        _TEARDOWN,
        limit,
    )
    return False
