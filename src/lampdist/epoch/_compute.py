"""One thread per rank for the rank's torch work: forward, backward and the optimizer step.

On the CPU, torch runs an operator's parallel part on an OpenMP team that belongs to the
calling thread, and the team's threads spin for a while after each operator. anyio's worker
pool hands successive calls to whichever thread is idle, so a rank's forward pass and its
optimizer step ran on different threads with a team each, spinning on the same cores. With
two intra-op threads on two cores the one-rank loop ran at 30% of the plain loop's speed.
Running all of a rank's compute on one thread keeps one team per rank.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import attrs
import torch

from .._signal import Signal

__all__ = ["ComputeThread"]

T = TypeVar("T")

_STOP = None


@attrs.define(eq=False)
class _Call:
    function: Callable[..., Any]
    args: tuple[Any, ...]
    done: Signal = attrs.field(factory=Signal)
    result: Any = None
    error: BaseException | None = None


@attrs.define(eq=False)
class ComputeThread:
    """A thread that runs one rank's compute calls in order; started on first use, stopped
    by :meth:`close` (which the rank's role calls on every path)."""

    name: str
    device: torch.device
    _queue: queue.SimpleQueue[_Call | None] = attrs.field(factory=queue.SimpleQueue, init=False)
    _thread: threading.Thread | None = attrs.field(default=None, init=False)

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` on the compute thread, awaited without blocking the loop.

        Like ``anyio.to_thread.run_sync``, a call runs to its end once started: a cancellation
        of the caller takes effect when it returns. Its exception is raised here.
        """
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self._thread.start()
        call = _Call(function, args)
        self._queue.put(call)
        with anyio.CancelScope(shield=True):
            await call.done.wait()
        if call.error is not None:
            error, call.error = call.error, None  # no cycle through this frame
            raise error
        result: T = call.result
        return result

    def close(self) -> None:
        """Stop the thread once the calls queued before this one have run."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(_STOP)
            thread.join()

    def _serve(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while (call := self._queue.get()) is not _STOP:
            try:
                call.result = call.function(*call.args)
            except BaseException as exc:
                call.error = exc
            finally:
                call.done.set()
            del call
