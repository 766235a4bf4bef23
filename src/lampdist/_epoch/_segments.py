"""A training pass run as segments of steps (``Recovery(snapshot_every_steps=K)``).

Under recovery with ``snapshot_every_steps`` the root runs each training window as
consecutive segments of at most K steps, one TRAIN command each (its ``segment``), and keeps a
snapshot after each; a loss then redoes at most one segment. Between the segments of a pass a
rank's kernel keeps the pass open (its tally, metrics, watch, gradient norms), so that the
pass's sums are the same as those of a pass run at once: every step is counted once, in the
same order.

A snapshot taken at a segment's end holds, in each rank's :class:`RankState`, the pass's
running sums so far on that rank (:func:`carried`); a recovery gives each rank its own, and the
redone segment starts a new pass on the new clique that goes on from them
(:func:`carry_on`). Every part is carried as it is summed (float64 sums, integer counts, the
metrics' tensors copied to the host and back), so the sums that follow are bitwise those of the
uninterrupted pass. Not carried: the step split's clock and the pass's seconds (measurements),
which after a recovery cover the steps since it.

Everything here runs on the rank's compute thread.
"""

from __future__ import annotations

from typing import Any

from ._metrics import MetricTally
from ._model_code import ModelCode
from ._stepper import Stepper
from ._tally import Tally
from ._watch import PassWatch

__all__ = ["carried", "carry_on", "segments"]


def segments(window: int, length: int) -> list[tuple[int, int, int]]:
    """The segments ``(first, stop, length)`` of a window of ``window`` steps, ``length``
    steps each but the last."""
    return [(first, min(first + length, window), length) for first in range(0, window, length)]


def carried(
    step: int,
    tally: Tally,
    metrics: MetricTally | None,
    watch: PassWatch,
    stepper: Stepper | None,
) -> dict[str, Any]:
    """The open pass's running sums on this rank after its first ``step`` steps (a segment's
    end, every step counted), in plain values and host tensors."""
    return {
        "step": step,
        "tally": tally.carried(),
        "metrics": None if metrics is None else metrics.carried(),
        "watch": [
            watch.tokens,
            watch.untokened,
            watch.examples,
            watch.weight,
            watch.feed.batches_read - watch.first_batch,
        ],
        "norms": None if stepper is None else stepper.carried_norms(),
    }


def carry_on(
    sums: dict[str, Any],
    step: int,
    tally: Tally,
    metrics: MetricTally | None,
    watch: PassWatch,
    code: ModelCode,
    stepper: Stepper | None,
) -> None:
    """Have a pass just started go on from ``sums`` (:func:`carried`'s), at ``step``.

    Raises :class:`AssertionError` when the sums were taken at another step (the root's
    segment and the snapshot disagree)."""
    if sums["step"] != step:
        raise AssertionError(f"the pass's sums were kept at step {sums['step']}, not {step}")
    tally.carry_on(sums["tally"])
    if metrics is not None:
        metrics.carry_on(sums["metrics"])
    watch.tokens, watch.untokened, watch.examples, watch.weight, batches = sums["watch"]
    watch.first_batch -= batches  # the events count the pass's batches from its start
    code.first_batch -= batches
    if stepper is not None and sums["norms"] is not None:
        stepper.carry_norms_on(sums["norms"])
