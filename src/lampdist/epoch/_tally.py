"""The running totals of a training pass, read back from the device without stalling it.

On CUDA, reading a step's example count and loss right after the step would make the host
wait for the device, so the next step could not be queued while this one runs. The tally
instead copies each step's reduced ``meta`` into pinned host memory behind a CUDA event and
reads it once the event has passed, a step or two later; only the pass's end waits for all.
Everything here runs on the rank's compute thread.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import attrs
import torch

from .._errors import NonFiniteLoss

__all__ = ["ReadbackSlots", "Tally"]


@attrs.define(eq=False)
class _Readback:
    step: int
    host: torch.Tensor
    """``[examples, loss sum, ...]``, or the loss sum alone when ``examples`` is given."""
    event: torch.cuda.Event | None
    examples: int | None = None
    factor: float = 1.0
    """What the loss read back is multiplied by (the examples of a mean loss)."""

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())  # type: ignore[no-untyped-call]  # torch.cuda.Event is untyped


@attrs.define(eq=False)
class Tally:
    """Examples, loss sum and skipped steps of the clique over one pass, on a stepping rank."""

    rank: int
    epoch: int
    examples: int = 0
    loss_sum: float = 0.0
    skipped: int = 0
    steps_read: int = 0
    slots: ReadbackSlots | None = None
    """Pinned buffers and CUDA events to reuse (the kernel's, across passes)."""
    _pending: deque[_Readback] = attrs.field(factory=deque)

    @property
    def loss(self) -> float:
        """The example-weighted mean loss so far (NaN before any example)."""
        return self.loss_sum / self.examples if self.examples else math.nan

    def record(self, examples: float, loss_sum: float, *, counted: bool) -> None:
        """Count a step whose values the host already holds."""
        self.steps_read += 1
        if counted:
            self.examples += int(examples)
            self.loss_sum += loss_sum
        elif examples > 0:
            self.skipped += 1

    def submit(self, step: int, meta: torch.Tensor) -> None:
        """Queue the read-back of a step's reduced ``[examples, loss sum, ...]`` (it stepped)."""
        if meta.device.type == "cuda":
            self._pending.append(_Readback(step, *self._to_host(meta)))
        else:
            self._pending.append(_Readback(step, meta.clone(), None))

    def submit_loss(
        self, step: int, examples: int, loss: torch.Tensor, *, factor: float = 1.0
    ) -> None:
        """Queue the read-back of a step's loss sum, ``loss`` times ``factor``, over
        ``examples`` (a rank alone, which stepped); ``loss`` must not change afterwards."""
        if loss.device.type == "cuda":
            host, event = self._to_host(loss)
            self._pending.append(_Readback(step, host, event, examples=examples, factor=factor))
        else:
            self._pending.append(_Readback(step, loss, None, examples=examples, factor=factor))

    def poll(self) -> None:
        """Count every queued step whose values have reached the host.

        Raises :class:`NonFiniteLoss` naming the first step whose loss was not finite.
        """
        while self._pending and self._pending[0].ready():
            self._take(self._pending.popleft())

    def drain(self) -> None:
        """Wait for every queued read-back and count it (the compute thread; on CUDA an
        aborted clique ends a collective that never finishes, and with it this wait)."""
        while self._pending:
            readback = self._pending.popleft()
            if readback.event is not None and not readback.ready():
                readback.event.synchronize()
            self._take(readback)

    def _to_host(self, values: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """A pinned copy of device ``values`` on its way, and the event that says it arrived."""
        host, event = (self.slots or ReadbackSlots()).take(values)
        host.copy_(values, non_blocking=True)
        event.record(torch.cuda.current_stream(values.device))
        return host, event

    def _take(self, readback: _Readback) -> None:
        if readback.examples is None:
            examples, loss_sum = readback.host.tolist()[:2]
        else:
            examples, loss_sum = readback.examples, readback.host.item() * readback.factor
        if readback.event is not None and self.slots is not None:
            self.slots.give_back(readback.host, readback.event)
        if not math.isfinite(loss_sum):
            raise NonFiniteLoss(
                f"epoch {self.epoch}, step {readback.step}: the summed loss of the step is "
                f"{loss_sum}; pass non_finite_loss='skip' to skip such steps (with "
                "non_finite_loss='raise' the check may lag the step by one or two steps)",
                rank=self.rank,
                phase="train",
            )
        self.record(examples, loss_sum, counted=True)


@attrs.define(eq=False)
class ReadbackSlots:
    """Pinned host buffers and CUDA events for read-backs, reused from step to step (an
    allocation and an event creation a step cost the host more than the copy)."""

    _free: dict[tuple[tuple[int, ...], torch.dtype], list[tuple[torch.Tensor, Any]]] = attrs.field(
        factory=dict
    )

    def take(self, like: torch.Tensor) -> tuple[torch.Tensor, Any]:
        free = self._free.get((tuple(like.shape), like.dtype))
        if free:
            return free.pop()
        host = torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
        return host, torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch

    def give_back(self, host: torch.Tensor, event: Any) -> None:
        self._free.setdefault((tuple(host.shape), host.dtype), []).append((host, event))
