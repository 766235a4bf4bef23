"""Where a training step's time goes, on the rank's compute thread.

A step is cut into parts at the points where its design moves from one kind of work to the
next: :data:`DATA` (waiting for the next batch), :data:`FORWARD_BACKWARD`, :data:`EXCHANGE`
(waiting for the gradients' and parameters' collectives), :data:`OPTIMIZER` (averaging,
clipping, the optimizer's step) and :data:`IDLE` (the rest of the step: the host's
bookkeeping between the parts, the progress event, and on a GPU the time the device waited
for the host). :meth:`StepClock.mark` closes the stretch since the previous mark as one part.

On the CPU the clock reads ``time.perf_counter`` at each mark. On CUDA it records a timing
event on the compute stream at each mark, and reads the elapsed time between two events once
the second has passed (``Event.query``, which does not wait, asked of every
:data:`READ_AT_ONCE`-th event): no host synchronization is added to a step. The events come
from a pool, so a pass creates only as many as are in flight. :meth:`StepClock.finish` waits
for the last ones, at the pass's end.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import attrs
import torch

__all__ = [
    "DATA",
    "EXCHANGE",
    "FORWARD_BACKWARD",
    "IDLE",
    "NO_CLOCK",
    "OPTIMIZER",
    "PARTS",
    "StepClock",
    "start_clock",
]

PARTS = ("data", "forward_backward", "exchange", "optimizer", "idle")
"""The parts of a step, in the order of :class:`lampdist.StepSplit`'s fields."""
DATA, FORWARD_BACKWARD, EXCHANGE, OPTIMIZER, IDLE = range(len(PARTS))
READ_AT_ONCE = 16
"""Timing events read together on CUDA, after one query (a query costs the host as much as a
record)."""


class StepClock:
    """Seconds per part of the steps of one pass; this base measures nothing (the step
    split is off)."""

    steps: int = 0

    def start_step(self) -> None:
        """A step begins: the time since the last mark was :data:`IDLE`."""

    def mark(self, part: int) -> None:
        """The time since the last mark was ``part``."""

    def finish(self) -> list[float]:
        """The pass's seconds per part, in the order of :data:`PARTS` (waits for the device
        where the clock uses events)."""
        return [0.0] * len(PARTS)


NO_CLOCK = StepClock()
"""The clock of a design outside a measured pass."""


@attrs.define(eq=False)
class HostClock(StepClock):
    """The step split by the host's clock (a CPU rank)."""

    steps: int = 0
    _totals: list[float] = attrs.field(factory=lambda: [0.0] * len(PARTS))
    _last: float | None = None

    def start_step(self) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self._totals[IDLE] += now - self._last
        self._last = now
        self.steps += 1

    def mark(self, part: int) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self._totals[part] += now - self._last
        self._last = now

    def finish(self) -> list[float]:
        return list(self._totals)


@attrs.define(eq=False)
class DeviceClock(StepClock):
    """The step split by CUDA timing events on the compute stream (a GPU rank)."""

    stream: Any
    pool: list[Any]
    """Free timing events, shared by the rank's passes."""
    steps: int = 0
    _totals: list[float] = attrs.field(factory=lambda: [0.0] * len(PARTS))
    _marks: deque[tuple[Any, int]] = attrs.field(factory=deque)
    """Events recorded and not read yet, each with the part it closes."""
    _previous: Any = None
    """The last event read (the start of the next stretch)."""

    def start_step(self) -> None:
        self._read()
        self.steps += 1
        self.mark(IDLE)

    def mark(self, part: int) -> None:
        event = self.pool.pop() if self.pool else torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # untyped in torch
        event.record(self.stream)
        self._marks.append((event, part))

    def _read(self) -> None:
        """Count the stretches whose closing events have passed, :data:`READ_AT_ONCE` at a
        time: one query of the last of them (events on one stream pass in order), none
        waited for."""
        marks = self._marks
        while len(marks) >= READ_AT_ONCE and marks[READ_AT_ONCE - 1][0].query():
            for _ in range(READ_AT_ONCE):
                self._count(*marks.popleft())

    def _count(self, event: Any, part: int) -> None:
        previous = self._previous
        if previous is not None:
            self._totals[part] += previous.elapsed_time(event) / 1000.0
            self.pool.append(previous)
        self._previous = event

    def finish(self) -> list[float]:
        if self._marks:
            self._marks[-1][0].synchronize()
        while self._marks:
            self._count(*self._marks.popleft())
        if self._previous is not None:
            self.pool.append(self._previous)
            self._previous = None
        return list(self._totals)


def start_clock(device: torch.device, pool: list[Any]) -> StepClock:
    """A clock for one pass on ``device``: events on CUDA (from ``pool``), else the host's."""
    if device.type == "cuda":
        return DeviceClock(stream=torch.cuda.current_stream(device), pool=pool)
    return HostClock()
