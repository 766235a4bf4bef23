"""A training pass's telemetry: what each rank measures, and what the root makes of it.

Each rank measures its own steps (the step split of ``_clock`` and the tokens of its batches,
see ``_watch``) and sends one row of numbers to the root at the pass's end, in the pass's one
reduce (every rank writes its row of a ranks-by-:data:`ROW` matrix, the others zero). The root
turns the rows into :class:`~lampdist.StepSplit` values and the clique's tokens, and names a
straggler (:class:`Stragglers`): a rank whose own work took more than
:data:`STRAGGLER_MARGIN` longer than the other ranks' in :data:`STRAGGLER_PASSES` training
passes in a row.
"""

from __future__ import annotations

import statistics

import attrs

from .._state import StepSplit
from ._clock import PARTS

__all__ = [
    "ROW",
    "STRAGGLER_MARGIN",
    "STRAGGLER_PASSES",
    "Stragglers",
    "examples",
    "splits",
    "straggler",
    "tokens",
]

ROW = ("steps", *PARTS, "tokens", "batches without tokens", "examples")
"""What each rank's row holds, in order."""

STRAGGLER_MARGIN = 0.10
"""How much longer than the other ranks' (their median) a rank's own work over a training pass
must take for the pass to count against it: 10%. A rank's own work is what every rank of the
design does alike: its data and its forward and backward, and its optimizer step where every
rank steps (not under ``step_on="root"``, where only the root steps and the followers wait for
it in the exchange). A pass sums all its steps, so one slow step does not count."""

STRAGGLER_PASSES = 3
"""How many training passes in a row must count against a rank before the root names it a
straggler (and every as many passes after, while it stays one): a healthy run's passes differ
now and then, a straggler's every time."""

_MIN_EXCESS = 0.001
"""Seconds per step a straggler's own work must exceed the others' by, at least (timer noise
on steps of microseconds is no straggler)."""

_OWN_PARTS = ("data", "forward_backward")
_STEPPING_PARTS = (*_OWN_PARTS, "optimizer")


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


def examples(rows: list[list[float]]) -> int:
    """The clique's examples (the batches the ranks ran forward)."""
    return round(sum(row[8] for row in rows))


def _own(split: StepSplit, parts: tuple[str, ...]) -> float:
    return float(sum(getattr(split, part) for part in parts))


def straggler(
    split: tuple[StepSplit, ...], *, every_rank_steps: bool = True
) -> tuple[int, str] | None:
    """The rank whose own work over one training pass (see :data:`STRAGGLER_MARGIN`) took
    more than the margin longer than the other ranks' median, and what to say of it: the part
    of its step furthest above the others' for that part; ``None`` when no rank did."""
    if len(split) < 2:
        return None
    parts = _STEPPING_PARTS if every_rank_steps else _OWN_PARTS
    slowest = max(split, key=lambda s: _own(s, parts))
    others = [s for s in split if s is not slowest]
    median = statistics.median(_own(s, parts) for s in others)
    if median <= 0:
        return None
    steps = max(slowest.steps, 1)
    excess = _own(slowest, parts) - median
    if excess <= STRAGGLER_MARGIN * median or excess / steps < _MIN_EXCESS:
        return None
    over = {
        part: getattr(slowest, part) - statistics.median(getattr(s, part) for s in others)
        for part in parts
    }
    part = max(over, key=lambda name: over[name])
    mine = getattr(slowest, part) / steps
    theirs = statistics.median(getattr(s, part) / max(s.steps, 1) for s in others)
    return slowest.rank, (
        f"its own work took {_own(slowest, parts) / median:.2f}x the other ranks' median over "
        f"the pass's {slowest.steps} steps; its slow part is {part} ({mine * 1000:.2f} ms a "
        f"step against the others' {theirs * 1000:.2f} ms)"
    )


@attrs.define(eq=False)
class Stragglers:
    """The root's account of stragglers over the training passes of a run: a rank is named
    once :data:`STRAGGLER_PASSES` passes in a row counted against it (:func:`straggler`)."""

    every_rank_steps: bool
    """Whether every rank steps its optimizer (the design's ``followers_step``)."""
    _rank: int | None = attrs.field(default=None, init=False)
    _streak: int = attrs.field(default=0, init=False)

    def judge(self, split: tuple[StepSplit, ...]) -> str | None:
        """What to log of this pass's ``split``, or ``None``."""
        found = straggler(split, every_rank_steps=self.every_rank_steps)
        if found is None:
            self._rank, self._streak = None, 0
            return None
        rank, why = found
        self._streak = self._streak + 1 if rank == self._rank else 1
        self._rank = rank
        if self._streak % STRAGGLER_PASSES:
            return None
        return f"rank {rank} is a straggler in {self._streak} training passes in a row: {why}"
