"""The running totals of a training pass, read back from the device without stalling it.

On CUDA, reading a step's example count and loss right after the step would make the host
wait for the device, so the next step could not be queued while this one runs. The tally
instead copies each step's values into a small ring on the device (one copy kernel a step)
and sends the ring to pinned host memory behind a CUDA event once it holds :data:`RING`
steps or :data:`FLUSH_INTERVAL` seconds have passed; it counts them once the event has
passed, and only the pass's end waits for all. A read-back a step cost the host more than the
step's own small kernels (a pinned buffer, a copy and an event each). On the CPU the values
are counted at once. Everything here runs on the rank's compute thread.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import attrs
import torch

from ._blame import non_finite_error

__all__ = ["FLUSH_INTERVAL", "RING", "ReadBack", "Tally"]

RING = 16
"""Steps whose values go to the host in one copy, at most."""
FLUSH_INTERVAL = 0.02
"""Seconds after which the steps gathered so far go to the host even when the ring is not
full (slow steps are read back step by step)."""


@attrs.define(eq=False)
class _Entry:
    step: int
    examples: int | None
    """The step's examples when the host knows them, else ``None`` (read back with the loss)."""
    factor: float
    """What the loss read back is multiplied by (the examples of a mean loss)."""
    own: torch.Tensor | None = None
    """The rank's own loss sum of the step, on the device, when the values read back are the
    clique's (``None`` for a rank alone, whose loss is the step's)."""


@attrs.define(eq=False)
class _Flight:
    """Steps on their way to the host: ``host[:len(entries)]`` once ``event`` has passed."""

    entries: list[_Entry]
    host: torch.Tensor
    event: Any


@attrs.define(eq=False)
class ReadBack:
    """What a rank's tallies reuse from pass to pass on CUDA: the ring on the device, and
    pinned host buffers with their events."""

    device: torch.device
    _ring: torch.Tensor | None = attrs.field(default=None, init=False)
    _free: list[tuple[torch.Tensor, Any]] = attrs.field(factory=list, init=False)
    _rows: list[torch.Tensor] = attrs.field(factory=list, init=False)
    _loss_cells: list[torch.Tensor] = attrs.field(factory=list, init=False)

    @property
    def ring(self) -> torch.Tensor:
        """``RING`` rows of ``[examples, loss sum]`` in float64 on the device."""
        if self._ring is None:
            self._ring = torch.zeros(RING, 2, dtype=torch.float64, device=self.device)
        return self._ring

    @property
    def rows(self) -> list[torch.Tensor]:
        """The ring's rows, as views made once (indexing the ring is an operator a step)."""
        if not self._rows:
            self._rows = list(self.ring.unbind())
        return self._rows

    @property
    def loss_cells(self) -> list[torch.Tensor]:
        """The loss sum of each of the ring's rows, as views made once."""
        if not self._loss_cells:
            self._loss_cells = [row[1] for row in self.rows]
        return self._loss_cells

    def take(self) -> tuple[torch.Tensor, Any]:
        """A pinned ``RING x 2`` buffer and a CUDA event, reused when one is free."""
        if self._free:
            return self._free.pop()
        host = torch.empty(RING, 2, dtype=torch.float64, pin_memory=True)
        return host, torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch

    def give_back(self, host: torch.Tensor, event: Any) -> None:
        self._free.append((host, event))


@attrs.define(eq=False)
class Tally:
    """Examples, loss sum and skipped steps of the clique over one pass, on a stepping rank.

    ``examples`` counts what the loss is a mean over (:attr:`LoadedBatch.weight`: examples,
    or tokens for a model with ``mean_over="tokens"``), the weight of the mean :attr:`loss`;
    the events' examples are the watch's (see :meth:`PassWatch.reported_examples`)."""

    rank: int
    epoch: int
    read_back: ReadBack | None = None
    """The kernel's ring and buffers (needed on CUDA)."""
    nranks: int = 1
    """The ranks of the clique (alone, the step's loss is the rank's own)."""
    examples: int = 0
    loss_sum: float = 0.0
    skipped: int = 0
    steps_read: int = 0
    window: int | None = None
    """With ``on_window``: every this many steps counted, ``on_window(steps_read, examples,
    loss)`` gets the window's examples and their weighted mean loss (``LoopOptions.
    log_every_n_steps``; the windows restart with each pass)."""
    on_window: Callable[[int, int, float], None] | None = None
    _window_examples: int = attrs.field(default=0, init=False)
    _window_loss_sum: float = attrs.field(default=0.0, init=False)
    _entries: list[_Entry] = attrs.field(factory=list, init=False)
    _flights: deque[_Flight] = attrs.field(factory=deque, init=False)
    _flushed: float = attrs.field(factory=time.monotonic, init=False)

    @property
    def loss(self) -> float:
        """The weighted mean loss so far (NaN before any weight)."""
        return self.loss_sum / self.examples if self.examples else math.nan

    def record(self, examples: float, loss_sum: float, *, counted: bool) -> None:
        """Count a step whose values the host already holds."""
        self.steps_read += 1
        if counted:
            self.examples += int(examples)
            self.loss_sum += loss_sum
            self._window_examples += int(examples)
            self._window_loss_sum += loss_sum
        elif examples > 0:
            self.skipped += 1
        if self.on_window is not None and self.window and self.steps_read % self.window == 0:
            examples_in, sum_in = self._window_examples, self._window_loss_sum
            self._window_examples, self._window_loss_sum = 0, 0.0
            self.on_window(
                self.steps_read, examples_in, sum_in / examples_in if examples_in else math.nan
            )

    def carried(self) -> list[float]:
        """The pass's sums so far, to go on from (a segment's end, every step counted: see
        :meth:`drain`)."""
        return [
            self.examples,
            self.loss_sum,
            self.skipped,
            self.steps_read,
            self._window_examples,
            self._window_loss_sum,
        ]

    def carry_on(self, carried: list[float]) -> None:
        """Go on from :meth:`carried`'s sums (a new tally of the same pass)."""
        examples, self.loss_sum, skipped, steps, window_examples, self._window_loss_sum = carried
        self.examples, self.skipped, self.steps_read = int(examples), int(skipped), int(steps)
        self._window_examples = int(window_examples)

    def submit(self, step: int, meta: torch.Tensor, *, own: torch.Tensor) -> None:
        """Count a step's reduced ``[examples, loss sum, ...]`` (it stepped), once it has
        reached the host; ``own`` is this rank's loss sum of the step."""
        if meta.device.type != "cuda":
            examples, loss_sum = meta.tolist()[:2]
            self._count(_Entry(step, None, 1.0, own), examples, loss_sum)
            return
        self._read_back(meta.device).rows[len(self._entries)].copy_(meta[:2])
        self._entries.append(_Entry(step, None, 1.0, own))

    def submit_loss(
        self, step: int, examples: int, loss: torch.Tensor, *, factor: float = 1.0
    ) -> None:
        """Count a step's loss sum, ``loss`` times ``factor``, over ``examples`` (a rank alone,
        which stepped), once it has reached the host."""
        if not loss.is_cuda:
            self._count(_Entry(step, examples, factor), examples, loss.item())
            return
        read_back = self.read_back
        if read_back is None:
            read_back = self._read_back(loss.device)
        read_back.loss_cells[len(self._entries)].copy_(loss)
        self._entries.append(_Entry(step, examples, factor))

    def poll(self) -> None:
        """Send the gathered steps to the host when due, and count every step whose values
        have arrived.

        Raises :class:`NonFiniteLoss` naming the first step whose loss was not finite, and
        the rank if its own loss was not (a rank alone: always).
        """
        if self._entries and (
            len(self._entries) == RING or time.monotonic() - self._flushed >= FLUSH_INTERVAL
        ):
            self._flush()
        while self._flights and self._flights[0].event.query():
            self._take(self._flights.popleft())

    def drain(self) -> None:
        """Wait for every step's values and count them (the compute thread; on CUDA an aborted
        clique ends a collective that never finishes, and with it this wait)."""
        self._flush()
        while self._flights:
            flight = self._flights.popleft()
            flight.event.synchronize()
            self._take(flight)

    def _read_back(self, device: torch.device) -> ReadBack:
        if self.read_back is None:
            self.read_back = ReadBack(device)
        return self.read_back

    def _flush(self) -> None:
        """Copy the ring's gathered rows to pinned memory behind an event (same stream as the
        rows' copies, so the ring's next rows are written after this copy has read it)."""
        if not self._entries or self.read_back is None:
            return
        count = len(self._entries)
        host, event = self.read_back.take()
        ring = self.read_back.ring
        host[:count].copy_(ring[:count], non_blocking=True)
        event.record(torch.cuda.current_stream(ring.device))
        self._flights.append(_Flight(self._entries, host, event))
        self._entries = []
        self._flushed = time.monotonic()

    def _take(self, flight: _Flight) -> None:
        rows = flight.host[: len(flight.entries)].tolist()
        if self.read_back is not None:
            self.read_back.give_back(flight.host, flight.event)
        for entry, (examples, loss_sum) in zip(flight.entries, rows, strict=True):
            self._count(entry, examples, loss_sum, lag=RING)

    def _count(
        self, entry: _Entry, examples: float, loss_sum: float, *, lag: int | None = None
    ) -> None:
        if entry.examples is not None:
            examples = entry.examples
        loss_sum *= entry.factor
        if not math.isfinite(loss_sum):
            # Alone, the summed loss is the rank's own; else this rank knows only its own.
            own = loss_sum if entry.own is None else float(entry.own.item())
            raise non_finite_error(
                rank=self.rank,
                epoch=self.epoch,
                step=entry.step,
                summed=loss_sum,
                losses={self.rank: own},
                nranks=self.nranks,
                lag=lag,
            )
        self.record(examples, loss_sum, counted=True)
