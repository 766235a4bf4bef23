"""A rank's compute calls (forward, backward, the optimizer step), one at a time, off the loop.

Calls run in anyio's worker threads, so model code may use ``anyio.from_thread``, and one at
a time per rank. A call may wait for its peers (a training step waits for the gradient
exchange inside its call): ``on_cancel`` then makes it stop waiting when the caller is
cancelled, instead of the caller waiting out the collective's deadline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import attrs

__all__ = ["Compute"]

T = TypeVar("T")


@attrs.define(eq=False)
class Compute:
    """The compute calls of one rank."""

    _limiter: anyio.CapacityLimiter = attrs.field(factory=lambda: anyio.CapacityLimiter(1))

    async def run(
        self,
        function: Callable[..., T],
        *args: Any,
        on_cancel: Callable[[], object] | None = None,
    ) -> T:
        """``function(*args)`` in a worker thread; its exception is raised here.

        A started call runs to its end. When the caller is cancelled meanwhile, ``on_cancel``
        (if given) runs in another worker thread to make the call end early, the call is
        waited for, and then the cancellation is raised.
        """
        if on_cancel is None:
            return await anyio.to_thread.run_sync(function, *args, limiter=self._limiter)
        outcome: list[tuple[bool, Any]] = []
        ended = anyio.Event()

        async def call() -> None:
            try:
                value = await anyio.to_thread.run_sync(function, *args, limiter=self._limiter)
            except Exception as exc:
                outcome.append((False, exc))
            else:
                outcome.append((True, value))
            finally:
                ended.set()

        async with anyio.create_task_group() as group:
            group.start_soon(call)
            try:
                await ended.wait()
            except anyio.get_cancelled_exc_class():
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(on_cancel)
                    await ended.wait()
                raise
        succeeded, value = outcome[0]
        if not succeeded:
            raise value
        result: T = value
        return result
