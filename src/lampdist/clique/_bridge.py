"""The bridge from torch's completion callbacks to the event loop and to worker threads.

torch completes a collective on one of its own threads (a Gloo worker, NCCL's watchdog) or,
when the future is already complete, inline on the thread that adds the callback. The bridge
turns that into a :class:`~lampdist._wakeup.Wakeup`, which an async task awaits without
parking the event loop and a plain thread waits for with a timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator
from typing import Any, Protocol

import anyio
import anyio.lowlevel
import anyio.to_thread
import attrs

from .._errors import CliqueTimeout, Collective, CollectiveFailed, ConfigError, LampdistError, Phase
from .._wakeup import Wakeup, on_event_loop_thread
from ._trail import Entry, label

__all__ = ["PendingCollective", "Then", "on_event_loop_thread"]

logger = logging.getLogger(__name__)

# torch's enum WorkResult, the value of ``Work.get_future_result()`` (NCCL only).
_WORK_SUCCESS = 0
_WORK_TIMEOUT = 1

# A failure: the error class and its message; each observer builds its own instance so that
# the rank and phase are its own and tracebacks do not pile up on one shared object.
Failure = tuple[type[LampdistError], str]

# Seconds between polls of a device event: doubling from the first to the last.
_POLL_FIRST = 10e-6
_POLL_MAX = 100e-6


class _Owner(Protocol):
    """What a pending collective needs from the group that started it."""

    def _retire(self, pending: PendingCollective) -> None: ...

    def _fail(self, failure: Failure) -> None: ...

    def _translate(self, exc: BaseException, phase: Phase, what: str | None = None) -> Failure: ...

    def _account(self, failure: Failure) -> Failure:
        """``failure`` with what the owner can say of a timeout (blocking, bounded)."""
        ...


@attrs.define(eq=False)
class PendingCollective:
    """A collective that has been started and may not have finished yet.

    Returned by the ``Clique.start_*`` methods, which may be called from any thread (autograd
    hooks run on torch's backward thread). Await it on the event loop (``await pending`` or
    ``await pending.wait()``), or call :meth:`wait_blocking` from a worker thread; either
    raises :class:`~lampdist.CollectiveFailed` when the collective failed (a peer died or the
    clique was torn down) and :class:`~lampdist.CliqueTimeout` when it ran past the clique's
    ``collective_timeout``. On CUDA, waiting makes the current stream of the waiting thread
    wait for the collective; it does not block the host until the GPU has finished.

    Dropping a pending collective without waiting is allowed: the clique still waits for it
    when it closes.
    """

    name: Collective
    """The collective: ``"all_reduce"``, ``"broadcast"``, ...; the ``phase`` of its errors."""
    rank: int
    """The rank that started it."""
    _owner: _Owner = attrs.field(alias="owner", repr=False)
    _timeout: float | None = attrs.field(alias="timeout", repr=False)
    _started: float = attrs.field(factory=time.monotonic, init=False, repr=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)
    _works: list[Any] | None = attrs.field(default=None, init=False, repr=False)
    _host_left: int = attrs.field(default=0, init=False, repr=False)
    _device_left: int = attrs.field(default=0, init=False, repr=False)
    _device_event: Any = attrs.field(default=None, init=False, repr=False)
    _stream_sync: bool = attrs.field(default=False, init=False, repr=False)
    _keep_works: bool = attrs.field(default=False, init=False, repr=False)
    _failure: Failure | None = attrs.field(default=None, init=False, repr=False)
    _ready: Wakeup = attrs.field(factory=Wakeup, init=False, repr=False)
    _final: Wakeup = attrs.field(factory=Wakeup, init=False, repr=False)
    # Its record in the rank's trail (process groups): ``ended`` is set once it completed.
    _entry: Entry | None = attrs.field(default=None, init=False, repr=False)

    def done(self) -> bool:
        """Whether waiting would return (or raise) at once."""
        if not self._ready.is_set():
            return False
        event = self._device_event
        return event is None or self._failure is not None or bool(event.query())

    def __await__(self) -> Generator[Any, None, None]:
        return self.wait().__await__()

    async def wait(self) -> None:
        """Wait for the collective without blocking the event loop.

        Raises :class:`~lampdist.CollectiveFailed` or :class:`~lampdist.CliqueTimeout` (the
        clique's ``collective_timeout``, counted from the start; over a process group its
        message says where every rank is, which takes up to a few seconds to learn).
        Cancelling the wait does not cancel the collective: the clique waits for it when it
        closes.
        """
        if self._ready.is_set():
            await anyio.lowlevel.checkpoint()
        else:
            try:
                with anyio.fail_after(self._remaining()):
                    await self._ready.wait()
            except TimeoutError:
                if not self._ready.is_set():
                    raise self._error(await self._accounted(self._time_out())) from None
        if self._device_event is not None and not self._device_event.query():
            stop = threading.Event()
            try:
                done = await anyio.to_thread.run_sync(
                    self._poll_device, self._deadline(), stop, abandon_on_cancel=True
                )
            finally:
                stop.set()  # a cancelled wait leaves its polling thread behind: end it
            if not done:
                raise self._error(await self._accounted(self._time_out()))
        failure = self._outcome()
        if failure is not None and failure[0] is CliqueTimeout:
            failure = await self._accounted(failure)
        self._finish(failure)

    def wait_blocking(self, timeout: float | None) -> None:
        """Wait from a worker thread (never from the event loop thread: it would block it).

        ``timeout`` (seconds, ``None`` for the clique's own limit) bounds this wait; the
        clique's ``collective_timeout`` bounds it too. Raises :class:`~lampdist.CliqueTimeout`
        when either passes, :class:`~lampdist.CollectiveFailed` when the collective failed, and
        :class:`~lampdist.ConfigError` when called on an event loop thread.
        """
        if on_event_loop_thread():
            raise ConfigError(
                "wait_blocking() would block the event loop; use 'await pending' there",
                rank=self.rank,
                phase=self.name,
            )
        own = self._remaining()
        limits = [t for t in (own, timeout) if t is not None]
        limit = min(limits) if limits else None
        until = None if limit is None else time.monotonic() + limit
        if not self._ready.wait_blocking(limit) or (
            self._device_event is not None and not self._poll_device(until, None)
        ):
            if timeout is None or (own is not None and own <= timeout):
                raise self._error(self._owner._account(self._time_out()))
            raise CliqueTimeout(
                f"{self.name} did not complete within the {timeout} s given to wait_blocking()",
                rank=self.rank,
                phase=self.name,
            )
        failure = self._outcome()
        if failure is not None and failure[0] is CliqueTimeout:
            failure = self._owner._account(failure)
        self._finish(failure)

    # -- internal: called by the clique and by torch's callbacks -------------------------

    def _deadline(self) -> float | None:
        return None if self._timeout is None else self._started + self._timeout

    def _remaining(self) -> float | None:
        deadline = self._deadline()
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _poll_device(self, until: float | None, stop: threading.Event | None) -> bool:
        """Poll the device event (a worker thread): True once it has completed or the
        collective failed (``_finish`` raises the failure), False when ``until`` passed.

        Polled rather than waited for through torch, which reports a collective's end on
        the device only on its watchdog's next round, so that the ranks leave a barrier
        together (docs/performance.md).
        """
        event = self._device_event
        pause = _POLL_FIRST
        while not event.query():
            if self._failure is not None or (stop is not None and stop.is_set()):
                return True
            if until is not None and time.monotonic() >= until:
                return False
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX)
        return True

    def _label(self) -> str:
        """``"all_reduce #12 (4.0 MiB)"``, or the name alone without a trail."""
        return self.name if self._entry is None else label(self._entry)

    def _time_out(self) -> Failure:
        """The clique's deadline passed: fail the clique; the failure to raise."""
        message = f"{self._label()} did not complete within collective_timeout={self._timeout} s"
        self._owner._fail((CliqueTimeout, message))
        with self._lock:  # the owner may have said more (which ranks never started it)
            failure = self._failure
        if failure is not None and failure[0] is CliqueTimeout:
            return failure
        return CliqueTimeout, message

    async def _accounted(self, failure: Failure) -> Failure:
        """The owner's account of a timeout, from a worker thread (it waits for the peers)."""
        return await anyio.to_thread.run_sync(self._owner._account, failure, abandon_on_cancel=True)

    def _error(self, failure: Failure) -> LampdistError:
        cls, message = failure
        return cls(message, rank=self.rank, phase=self.name)

    def _outcome(self) -> Failure | None:
        with self._lock:
            return self._failure

    def _finish(self, failure: Failure | None) -> None:
        """Raise ``failure``, or order the current CUDA stream after the collective."""
        if failure is not None:
            raise self._error(failure)
        with self._lock:
            works = list(self._works) if self._stream_sync and self._works else []
        for work in works:
            try:
                work.wait()  # NCCL: the current stream waits for the collective; no host sync
            except Exception as exc:
                self._owner._fail(self._owner._translate(exc, self.name))
                cls, message = self._owner._translate(exc, self.name)
                raise cls(message, rank=self.rank, phase=self.name) from exc

    def _attach(
        self,
        works: list[Any],
        *,
        track_device: bool,
        device_event: Any = None,
        failure: Failure | None = None,
    ) -> None:
        """Take the enqueued works and register the completion callbacks (enqueuing thread).

        ``device_event`` (a CUDA event recorded after the works) makes waiting last until the
        device has run them too. ``failure`` says that enqueuing stopped part-way: the waiters
        learn at once, and the works that did start are still followed to their end.
        """
        device_futures = []
        if track_device:
            for work in works:
                try:
                    device_futures.append(work.get_future_result())
                except (AttributeError, RuntimeError):  # not in this backend or build
                    device_futures = []
                    break
        with self._lock:
            if self._failure is None:
                self._failure = failure
            self._works = works
            self._host_left = len(works)
            self._device_left = len(device_futures)
            self._device_event = device_event
            self._stream_sync = track_device
            # Without a device-side completion signal the works stay until the clique closes:
            # a waiter may still need them to order its stream.
            self._keep_works = track_device and not device_futures
        if failure is not None:
            self._ready.set()
        if not works:
            self._settle()
            return
        for work in works:
            work.get_future().add_done_callback(self._on_host_done)  # may run inline, here
        for future in device_futures:
            future.add_done_callback(self._on_device_done)

    def _fail(self, failure: Failure) -> None:
        """The clique failed: wake the waiters now; the works finish on their own."""
        with self._lock:
            if self._failure is None:
                self._failure = failure
        self._ready.set()

    def _on_host_done(self, future: Any) -> None:
        failure = None
        try:
            future.value()
        except Exception as exc:
            failure = self._owner._translate(exc, self.name, self._label())
        if failure is not None:
            self._owner._fail(failure)
        with self._lock:
            if failure is not None and self._failure is None:
                self._failure = failure
            self._host_left -= 1
        self._settle()

    def _on_device_done(self, future: Any) -> None:
        failure: Failure | None = None
        try:
            result = int(future.value())
        except Exception as exc:
            failure = self._owner._translate(exc, self.name)
        else:
            if result == _WORK_TIMEOUT:
                failure = (CliqueTimeout, f"{self._label()} timed out on the device")
            elif result != _WORK_SUCCESS:
                failure = (CollectiveFailed, f"{self.name} failed on the device (result {result})")
        if failure is not None:
            self._owner._fail(failure)
        with self._lock:
            if failure is not None and self._failure is None:
                self._failure = failure
            self._device_left -= 1
        self._settle()

    def _settle(self) -> None:
        with self._lock:
            host_done = self._host_left <= 0
            final = host_done and self._device_left <= 0
            if final and not self._keep_works:
                self._works = None  # finished on the device too: no stream to order, no refs
            failed = self._failure is not None
        if host_done:
            entry = self._entry
            if entry is not None and entry.ended is None:
                entry.failed = failed
                entry.ended = time.monotonic()
            self._ready.set()
        if final:
            self._final.set()
            self._owner._retire(self)

    def _release(self) -> None:
        """Drop the works (teardown, after the group is gone or the drain gave up)."""
        with self._lock:
            self._works = None


class Then:
    """A work whose future runs one more step on the thread that completes the collective."""

    def __init__(self, work: Any, step: Callable[[], object]) -> None:
        def then(future: Any) -> None:
            future.value()  # raises the collective's error, if any
            step()

        self._future = work.get_future().then(then)

    def get_future(self) -> Any:
        return self._future

    def wait(self) -> None:
        self._future.wait()

    def get_future_result(self) -> Any:
        raise RuntimeError("no device-side result for a CPU collective")
