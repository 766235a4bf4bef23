"""Per-step progress from the compute thread to ``on_event`` on the event loop, coalesced.

The compute thread publishes each step's :class:`PassEvent` and goes on at once. It wakes the
event loop for the pass's first step, for its last (``done=True``), and otherwise at most
every :data:`PROGRESS_INTERVAL` seconds, and never while a wake-up is outstanding; the loop
delivers the newest event to ``on_event``. Events published in between (and while a slow or
blocking ``on_event`` runs) are coalesced into the newest one: each event carries the pass's
totals so far, so nothing is lost but intermediate snapshots, and training never waits for
the loop. A wake-up per step would cost the loop, and the compute thread's hold on the GIL,
tens of microseconds a step. The last event is always delivered, and the pass ends after it
has been.

With ``every_n_steps`` (``LoopOptions.log_every_n_steps``) the events of each window of N
steps (:attr:`PassEvent.window_steps` set) are never coalesced: each is delivered, in order,
after the pass's first event and before the newest running one.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Literal, NamedTuple

import anyio
import attrs

from .._effects import OnPassEvent
from .._state import PassEvent
from .._wakeup import loop_scheduler

__all__ = ["PROGRESS_INTERVAL", "Progress"]

PROGRESS_INTERVAL = 0.05
"""Seconds between wake-ups of the event loop for progress within a pass (20 a second)."""


class ProgressFields(NamedTuple):
    """What every event of one pass shares."""

    epoch: int
    kind: Literal["train", "valid"]
    pass_index: int
    total_batches: int | None
    flops_per_example: float | None = None
    peak_flops: float | None = None

    def event(
        self,
        step: int,
        batches: int,
        examples: int,
        loss: float,
        seconds: float,
        tokens: int | None = None,
        *,
        done: bool = False,
    ) -> PassEvent:
        """The pass's event with these totals so far."""
        return PassEvent(
            epoch=self.epoch,
            kind=self.kind,
            pass_index=self.pass_index,
            step=step,
            batches=batches,
            total_batches=self.total_batches,
            examples=examples,
            loss=loss,
            seconds=seconds,
            done=done,
            tokens=tokens,
            flops_per_example=self.flops_per_example,
            peak_flops=self.peak_flops,
        )


_Step = tuple[ProgressFields, int, int, int, float, float, int | None]
"""An event not built yet: :meth:`Progress.publish_step`'s arguments."""


@attrs.define(eq=False)
class Progress:
    """The newest unread event of one pass (see the module docstring). Create it on the loop.

    Invariant: ``_wake_pending`` is True from a wake-up's scheduling until the loop has taken
    every event there is; only then may the compute thread schedule another. The pass's first
    event waits in ``_first``, the windows' events in ``_windows`` and the newest since in
    ``_latest``. The fields are guarded by ``_lock`` (the compute thread publishes, the loop
    takes).
    """

    every_n_steps: int | None = attrs.field(default=None)
    """``LoopOptions.log_every_n_steps``: the steps of a window whose event is never
    coalesced (:meth:`publish_window`); ``None``: no such events."""
    peak_flops: float | None = attrs.field(default=None)
    """``LoopOptions.peak_flops``: one device's peak FLOP/s for the pass's MFU, when given."""

    _schedule = attrs.field(factory=loop_scheduler, init=False, repr=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)
    _first: PassEvent | _Step | None = attrs.field(default=None, init=False)
    _published: bool = attrs.field(default=False, init=False)
    _latest: PassEvent | _Step | None = attrs.field(default=None, init=False)
    _windows: deque[PassEvent] = attrs.field(factory=deque, init=False)
    _wake_pending: bool = attrs.field(default=False, init=False)
    _next_wake: float = attrs.field(default=0.0, init=False)  # monotonic; 0: the first event
    _arrived: anyio.Event = attrs.field(factory=anyio.Event, init=False, repr=False)
    _ended: bool = attrs.field(default=False, init=False)
    delivered: int = attrs.field(default=0, init=False)
    """How many events reached ``on_event`` (fewer than published when coalesced)."""

    def publish(self, event: PassEvent) -> None:
        """Make ``event`` the newest (the compute thread); never waits for the loop."""
        self._offer(event, event.done)

    def publish_step(
        self,
        fields: ProgressFields,
        step: int,
        batches: int,
        examples: int,
        loss: float,
        seconds: float,
        tokens: int | None = None,
    ) -> None:
        """:meth:`publish` of ``fields.event(step, batches, examples, loss, seconds,
        tokens)``, an event not done, which is built on the loop if it is delivered (most are
        coalesced)."""
        self._offer((fields, step, batches, examples, loss, seconds, tokens), False)

    def publish_window(self, event: PassEvent) -> None:
        """Queue ``event``, a window's, for delivery (the compute thread); never coalesced,
        never waits for the loop."""
        with self._lock:
            self._windows.append(event)
            if self._wake_pending:
                return
            self._wake_pending = True
            self._next_wake = time.monotonic() + PROGRESS_INTERVAL
        self._schedule(self._wake)

    def _offer(self, event: PassEvent | _Step, done: bool) -> None:
        now = time.monotonic()
        with self._lock:
            if self._published:
                self._latest = event
            else:  # the pass's first event is kept until it is delivered
                self._first, self._published = event, True
            if self._wake_pending or (now < self._next_wake and not done):
                return
            self._wake_pending = True
            self._next_wake = now + PROGRESS_INTERVAL
        self._schedule(self._wake)

    def _wake(self) -> None:  # on the loop
        self._arrived.set()

    def end(self) -> None:
        """The compute thread published its last event (the loop): :meth:`deliver` returns
        once it has delivered what is left, also without a last event (a pass run as
        segments, whose segment ended)."""
        self._ended = True
        self._arrived.set()

    async def deliver(self, on_event: OnPassEvent) -> None:
        """Deliver events to ``on_event`` until the pass's last one, or until :meth:`end`
        and nothing is left (the loop)."""
        while True:
            await self._arrived.wait()
            self._arrived = anyio.Event()
            taken: PassEvent | _Step | None
            with self._lock:
                if self._first is not None:
                    taken, self._first = self._first, None
                elif self._windows:
                    taken = self._windows.popleft()
                else:
                    taken, self._latest = self._latest, None
                if self._latest is not None or self._windows or self._ended:
                    self._arrived.set()  # the rest follows at once
                else:
                    self._wake_pending = False
            if taken is None:
                if self._ended:
                    return
                continue
            if isinstance(taken, tuple):
                fields, step, batches, examples, loss, seconds, tokens = taken
                event = fields.event(step, batches, examples, loss, seconds, tokens)
            else:
                event = taken
            await on_event(event)
            self.delivered += 1
            if event.done:
                return
