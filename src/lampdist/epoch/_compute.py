"""A rank's compute calls (forward, backward, the optimizer step), one at a time, off the loop.

Inside a :meth:`Compute.session`, calls run one after another on one anyio worker thread, so
model code may use ``anyio.from_thread`` and the same OS thread runs every call of a pass
(which keeps OpenMP's thread team warm on the CPU). Handing a call to that thread and back
costs a queue put and one wake-up of the event loop, about half of a fresh
``anyio.to_thread.run_sync`` with a limiter, which matters at the thousands of steps a second
of a small model. A call may wait for its peers (a training step waits for the gradient
exchange inside its call): ``on_cancel`` then makes it stop waiting when the caller is
cancelled, instead of the caller waiting out the collective's deadline.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import attrs

from .._signal import loop_scheduler

__all__ = ["Compute"]

T = TypeVar("T")


@attrs.define(eq=False)
class _Call:
    function: Callable[..., Any]
    args: tuple[Any, ...]
    done: anyio.Event = attrs.field(factory=anyio.Event)
    outcome: tuple[bool, Any] = (False, None)


_Calls = queue.SimpleQueue[_Call | None]  # None ends the session's thread


def _serve(calls: _Calls, schedule: Callable[..., object]) -> None:
    """The session's thread: run each call, then wake its waiter on the loop."""
    while (call := calls.get()) is not None:
        try:
            call.outcome = (True, call.function(*call.args))
        except BaseException as exc:  # handed to the awaiting task, as to_thread does
            call.outcome = (False, exc)
        schedule(call.done.set)


@attrs.define(eq=False)
class Compute:
    """The compute calls of one rank."""

    _calls: _Calls | None = attrs.field(default=None, init=False)

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[None]:
        """Serve :meth:`run` on one worker thread until the block ends (the thread ends
        after the call it runs, if any: :meth:`run` never leaves a call running)."""
        if self._calls is not None:
            raise RuntimeError("a compute session is already open")
        calls: _Calls = queue.SimpleQueue()
        schedule = loop_scheduler()
        async with anyio.create_task_group() as group:
            group.start_soon(self._host, calls, schedule)
            self._calls = calls
            try:
                yield
            finally:
                self._calls = None
                calls.put(None)

    @staticmethod
    async def _host(calls: _Calls, schedule: Callable[..., object]) -> None:
        await anyio.to_thread.run_sync(_serve, calls, schedule, limiter=anyio.CapacityLimiter(1))

    async def run(
        self,
        function: Callable[..., T],
        *args: Any,
        on_cancel: Callable[[], object] | None = None,
    ) -> T:
        """``function(*args)`` on the session's thread; its exception is raised here.

        A started call runs to its end. When the caller is cancelled meanwhile, ``on_cancel``
        (if given) runs in another worker thread to make the call end early, the call is
        waited for, and then the cancellation is raised.
        """
        calls = self._calls
        if calls is None:
            raise RuntimeError("Compute.run needs an open compute session")
        await anyio.lowlevel.checkpoint_if_cancelled()
        call = _Call(function, args)
        calls.put(call)
        try:
            await call.done.wait()
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                if on_cancel is not None:
                    await anyio.to_thread.run_sync(on_cancel)
                await call.done.wait()
            raise
        succeeded, value = call.outcome
        if not succeeded:
            raise value
        result: T = value
        return result
