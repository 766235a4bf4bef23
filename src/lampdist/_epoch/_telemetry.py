"""A training pass's telemetry: what each rank measures, and what the root makes of it.

Each rank measures its own steps (:class:`PassTelemetry`: the step split of ``_clock`` and the
tokens of its batches) and sends one row of numbers to the root at the pass's end, in the
pass's one reduce (every rank writes its row of a ranks-by-:data:`ROW` matrix, the others
zero). The root turns the rows into :class:`~lampdist.StepSplit` values and the clique's
tokens, and names a straggler (:func:`straggler`): a rank whose own work over the pass took
more than :data:`STRAGGLER_MARGIN` longer than the median rank's.
"""

from __future__ import annotations

import statistics

import attrs

from .._state import StepSplit
from ._clock import PARTS, StepClock
from ._feed import LoadedBatch

__all__ = ["ROW", "STRAGGLER_MARGIN", "PassTelemetry", "splits", "straggler", "tokens"]

ROW = ("steps", *PARTS, "tokens", "batches without tokens")
"""What each rank's row holds, in order."""

STRAGGLER_MARGIN = 0.10
"""How much longer than the median rank's a rank's own work over a training pass
(:attr:`~lampdist.StepSplit.busy`: its steps' time less the exchange's) must take for the rank
to be logged as a straggler: 10%. A pass sums all its steps, so one slow step does not make a
straggler; a rank slow step after step does."""

_MIN_EXCESS = 0.001
"""Seconds per step a straggler's own work must exceed the median's by, at least (timer noise
on steps of microseconds is no straggler)."""


@attrs.define(eq=False)
class PassTelemetry:
    """One rank's measurements of one training pass (the compute thread)."""

    clock: StepClock
    tokens: int = 0
    untokened: int = 0
    """Batches that did not say how many tokens they hold."""
    examples: int = 0
    """The rank's own examples (the root's estimate of the clique's tokens mid-pass)."""

    def count(self, batch: LoadedBatch) -> None:
        """Count a batch the rank trains on."""
        if batch.tokens is None:
            self.untokened += 1
        else:
            self.tokens += batch.tokens
        self.examples += batch.examples

    def estimate_tokens(self, clique_examples: int) -> int | None:
        """The clique's tokens so far, from this rank's tokens per example (mid-pass)."""
        if self.untokened or self.examples == 0:
            return None
        return round(self.tokens / self.examples * clique_examples)

    def row(self) -> list[float]:
        """The rank's row (:data:`ROW`): waits for the clock's last events."""
        return [float(self.clock.steps), *self.clock.finish(), self.tokens, self.untokened]


def splits(rows: list[list[float]], *, measured: bool) -> tuple[StepSplit, ...]:
    """Every rank's step split from the ranks' rows (empty when not ``measured``)."""
    if not measured:
        return ()
    return tuple(
        StepSplit(rank=rank, steps=int(row[0]), **dict(zip(PARTS, row[1:6], strict=True)))
        for rank, row in enumerate(rows)
    )


def tokens(rows: list[list[float]]) -> int | None:
    """The clique's tokens, or ``None`` when a batch of any rank did not say."""
    if any(row[7] > 0 for row in rows):
        return None
    return round(sum(row[6] for row in rows))


def straggler(split: tuple[StepSplit, ...]) -> str | None:
    """What to log of a straggler among ``split`` (the ranks of one training pass), or
    ``None``: the slowest rank, when its own work took more than :data:`STRAGGLER_MARGIN`
    longer than the median rank's, with the part of its step that is furthest above the
    median rank's for that part."""
    if len(split) < 2:
        return None
    median = statistics.median(s.busy for s in split)
    if median <= 0:
        return None
    slowest = max(split, key=lambda s: s.busy)
    steps = max(slowest.steps, 1)
    excess = slowest.busy - median
    if excess <= STRAGGLER_MARGIN * median or excess / steps < _MIN_EXCESS:
        return None
    parts = ("data", "forward_backward", "optimizer", "idle")
    over = {
        part: getattr(slowest, part) - statistics.median(getattr(s, part) for s in split)
        for part in parts
    }
    part = max(over, key=lambda name: over[name])
    mine = getattr(slowest, part) / steps
    theirs = statistics.median(getattr(s, part) / max(s.steps, 1) for s in split)
    return (
        f"rank {slowest.rank} is a straggler: its own work took {slowest.busy / median:.2f}x "
        f"the median rank's over the pass's {slowest.steps} steps; its slow part is "
        f"{part} ({mine * 1000:.2f} ms a step against the median rank's {theirs * 1000:.2f} ms)"
    )
