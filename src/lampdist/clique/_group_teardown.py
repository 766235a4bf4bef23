"""Closing a group on every path: abort when the exit is abnormal, wait for the collectives
started, shut NCCL down cleanly, stop the threads, and drop every reference to the process
group within a deadline, so that no group or work object outlives the clique."""

from __future__ import annotations

import gc
import logging
import threading
from contextlib import nullcontext
from typing import Any

import anyio
import anyio.to_thread
import torch.distributed as dist

from .._errors import CliqueTimeout, Phase
from ._backends import describe as _describe
from ._group_watch import WATCHER_NAME, WatchingGroup
from ._sockets import TransportSockets

__all__ = ["ClosingGroup", "drop_within"]

logger = logging.getLogger(__name__)

_TEARDOWN: Phase = "clique teardown"
# How long the teardown waits for the watcher thread, which may be inside a store operation
# on a stalled store (it is a daemon: left behind, it ends with its socket).
_WATCHER_JOIN = 2.0
# How long rank 0, leaving cleanly, waits for the followers to release their cliques before
# it closes (and its rendezvous the store) behind them (see Tether.await_goodbyes).
_GOODBYE_WAIT = 2.0
_DRAIN_NO_LIMIT = 600.0  # how long close waits for pending work when collective_timeout is None
# NCCL groups of one process are shut down and destroyed one at a time: one group's shutdown
# beside another's destruction can crash the process (docs/reliability.md, Limits).
_NCCL_TEARDOWN = threading.Lock()
# How long the teardown waits for torch to destroy a process group (or for the lock above)
# before it leaves the group behind: a destructor may never return, and the clique's exit
# must not wait for it forever (docs/reliability.md, Limits).
_RELEASE_LIMIT = 60.0
_ABANDON_LIMIT = 1.0  # the same for a clique abandoned (Clique.abandon): a stalled peer


class ClosingGroup(WatchingGroup):
    """The group's teardown (see the module docstring)."""

    __slots__ = ()

    # -- teardown (the event loop thread, each blocking step in a worker thread) -----------

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

    # -- the teardown's worker threads -----------------------------------------------------

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
            watcher = thread.name.startswith(WATCHER_NAME)
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


# -- the process group's last references ---------------------------------------------------


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
