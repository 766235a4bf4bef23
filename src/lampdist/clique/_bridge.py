"""The bridge from torch's completion callbacks to the event loop and to worker threads.

torch completes a collective on one of its own threads (a Gloo worker, NCCL's watchdog) or,
when the future is already complete, inline on the thread that adds the callback. The bridge
turns that into a :class:`~lampdist._signal.Signal`, which an async task awaits without
parking the event loop and a plain thread waits for with a timeout.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Callable, Generator
from typing import Any, Protocol

import anyio
import anyio.lowlevel
import attrs

from .._errors import CliqueTimeout, CollectiveFailed, ConfigError, LampdistError
from .._signal import Signal

__all__ = ["PendingCollective", "Then"]

logger = logging.getLogger(__name__)

# torch's enum WorkResult, the value of ``Work.get_future_result()`` (NCCL only).
_WORK_SUCCESS = 0
_WORK_TIMEOUT = 1

# A failure: the error class and its message; each observer builds its own instance so that
# the rank and phase are its own and tracebacks do not pile up on one shared object.
Failure = tuple[type[LampdistError], str]


def _on_event_loop_thread() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return True
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:
            pass
        else:
            return True
    return False


class _Owner(Protocol):
    """What a pending collective needs from the group that started it."""

    def _retire(self, pending: PendingCollective) -> None: ...

    def _fail(self, failure: Failure) -> None: ...

    def _translate(self, exc: BaseException, phase: str) -> Failure: ...


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

    name: str
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
    _wait_for_device: bool = attrs.field(default=False, init=False, repr=False)
    _stream_sync: bool = attrs.field(default=False, init=False, repr=False)
    _keep_works: bool = attrs.field(default=False, init=False, repr=False)
    _failure: Failure | None = attrs.field(default=None, init=False, repr=False)
    _ready: Signal = attrs.field(factory=Signal, init=False, repr=False)
    _final: Signal = attrs.field(factory=Signal, init=False, repr=False)

    def done(self) -> bool:
        """Whether waiting would return (or raise) at once."""
        return self._ready.is_set()

    def __await__(self) -> Generator[Any, None, None]:
        return self.wait().__await__()

    async def wait(self) -> None:
        """Wait for the collective without blocking the event loop.

        Raises :class:`~lampdist.CollectiveFailed` or :class:`~lampdist.CliqueTimeout` (the
        clique's ``collective_timeout``, counted from the start). Cancelling the wait does not
        cancel the collective: the clique waits for it when it closes.
        """
        if self._ready.is_set():
            await anyio.lowlevel.checkpoint()
        else:
            try:
                with anyio.fail_after(self._remaining()):
                    await self._ready.wait()
            except TimeoutError:
                if not self._ready.is_set():
                    raise self._time_out() from None
        self._finish()

    def wait_blocking(self, timeout: float | None) -> None:
        """Wait from a worker thread (never from the event loop thread: it would block it).

        ``timeout`` (seconds, ``None`` for the clique's own limit) bounds this wait; the
        clique's ``collective_timeout`` bounds it too. Raises :class:`~lampdist.CliqueTimeout`
        when either passes, :class:`~lampdist.CollectiveFailed` when the collective failed, and
        :class:`~lampdist.ConfigError` when called on an event loop thread.
        """
        if _on_event_loop_thread():
            raise ConfigError(
                "wait_blocking() would block the event loop; use 'await pending' there",
                rank=self.rank,
                phase=self.name,
            )
        own = self._remaining()
        limits = [t for t in (own, timeout) if t is not None]
        if not self._ready.wait_blocking(min(limits) if limits else None):
            if timeout is None or (own is not None and own <= timeout):
                raise self._time_out()
            raise CliqueTimeout(
                f"{self.name} did not complete within the {timeout} s given to wait_blocking()",
                rank=self.rank,
                phase=self.name,
            )
        self._finish()

    # -- internal: called by the clique and by torch's callbacks -------------------------

    def _remaining(self) -> float | None:
        if self._timeout is None:
            return None
        return max(0.0, self._started + self._timeout - time.monotonic())

    def _time_out(self) -> CliqueTimeout:
        message = f"{self.name} did not complete within collective_timeout={self._timeout} s"
        self._owner._fail((CliqueTimeout, message))
        return CliqueTimeout(message, rank=self.rank, phase=self.name)

    def _finish(self) -> None:
        """Raise the failure, or order the current CUDA stream after the collective."""
        with self._lock:
            failure = self._failure
            works = list(self._works) if self._stream_sync and self._works else []
        if failure is not None:
            cls, message = failure
            raise cls(message, rank=self.rank, phase=self.name)
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
        wait_for_device: bool,
        failure: Failure | None = None,
    ) -> None:
        """Take the enqueued works and register the completion callbacks (enqueuing thread).

        ``failure`` says that enqueuing stopped part-way: the waiters learn at once, and the
        works that did start are still followed to their end.
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
            self._wait_for_device = wait_for_device and bool(device_futures)
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
            failure = self._owner._translate(exc, self.name)
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
                failure = (CliqueTimeout, f"{self.name} timed out on the device")
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
            ready = final if self._wait_for_device else host_done
            if final and not self._keep_works:
                self._works = None  # finished on the device too: no stream to order, no refs
        if ready:
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
