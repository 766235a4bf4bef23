"""Several trackers as one."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, Self

import attrs

from .._state import LoopState, PassEvent, Recovered
from ._base import Tracker

__all__ = ["fan_out"]


@attrs.define(eq=False)
class _FanOut:
    """Every call goes to each tracker in turn, in the order given."""

    trackers: tuple[Tracker, ...]
    _stack: AsyncExitStack | None = attrs.field(default=None, init=False)

    async def __aenter__(self) -> Self:
        async with AsyncExitStack() as stack:  # a tracker that fails to open closes the rest
            for tracker in self.trackers:
                await stack.enter_async_context(tracker)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.__aexit__(exc_type, exc, traceback)

    async def aclose(self) -> None:
        await self.__aexit__(None, None, None)

    async def __call__(self, event: PassEvent | Recovered, /) -> None:
        for tracker in self.trackers:
            await tracker(event)

    async def log_hyperparameters(self, hyperparameters: Mapping[str, Any], /) -> None:
        for tracker in self.trackers:
            await tracker.log_hyperparameters(hyperparameters)

    async def log_summary(self, state: LoopState, /) -> None:
        for tracker in self.trackers:
            await tracker.log_summary(state)


def fan_out(*trackers: Tracker) -> Tracker:
    """One :class:`Tracker` made of ``trackers``: ``async with`` opens each in turn and
    closes them all, in reverse order (those already open, when one fails to open); events,
    hyperparameters and the summary go to each in the order given.

    ``fan_out(TensorBoardTracker("runs/a"), CsvTracker("runs/a/csv"))`` is the way to give
    several trackers to ``LoopOptions(on_event=...)``.
    """
    return _FanOut(trackers)
