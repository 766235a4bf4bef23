"""A cross-thread wake-up: a one-shot flag set from any thread and awaited on any event loop
without parking it (OS signals are handled in ``_roles/_train.py``).

Setting it schedules ``anyio.Event.set`` on each waiting task's own loop through the loop's
thread-safe entry point, so it never blocks and never deadlocks when it runs on the loop
thread itself (a torch future's callback runs inline when the future is already complete).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections.abc import Callable

import anyio
import anyio.lowlevel
import attrs

__all__ = ["Wakeup", "loop_scheduler", "on_event_loop_thread"]


def on_event_loop_thread() -> bool:
    """Whether the calling thread runs an asyncio or trio event loop."""
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


def loop_scheduler() -> Callable[[Callable[[], object]], None]:
    """A function that runs a callback on the current event loop soon: from any thread,
    without blocking, and as a no-op once the loop has finished (nobody waits any more)."""
    native = anyio.lowlevel.current_token().native_token
    if isinstance(native, asyncio.AbstractEventLoop):
        schedule: Callable[[Callable[[], object]], object] = native.call_soon_threadsafe
    else:  # trio: a TrioToken
        schedule = native.run_sync_soon  # type: ignore[attr-defined]  # TrioToken is untyped here

    def run_soon(callback: Callable[[], object]) -> None:
        with contextlib.suppress(RuntimeError):
            schedule(callback)

    return run_soon


def _loop_waker(event: anyio.Event) -> Callable[[], None]:
    """A callable that sets ``event`` on the current event loop, from any thread, at once."""
    run_soon = loop_scheduler()
    return lambda: run_soon(event.set)


@attrs.define(eq=False)
class Wakeup:
    """A one-shot, thread-safe wake-up: set from any thread, awaited on any event loop."""

    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    _flag: threading.Event = attrs.field(factory=threading.Event, init=False)
    _wakers: list[Callable[[], None]] = attrs.field(factory=list, init=False)

    def set(self) -> None:
        with self._lock:
            if self._flag.is_set():
                return
            self._flag.set()
            wakers, self._wakers = self._wakers, []
        for wake in wakers:
            wake()

    def is_set(self) -> bool:
        return self._flag.is_set()

    def wait_blocking(self, timeout: float | None) -> bool:
        return self._flag.wait(timeout)

    async def wait(self) -> None:
        event = anyio.Event()
        wake = _loop_waker(event)
        with self._lock:
            if self._flag.is_set():
                registered = False
            else:
                self._wakers.append(wake)
                registered = True
        if not registered:
            await anyio.lowlevel.checkpoint()
            return
        try:
            await event.wait()
        finally:
            with self._lock:
                if wake in self._wakers:
                    self._wakers.remove(wake)
