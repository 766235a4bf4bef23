"""Several validation sets as one validation outcome: the driving set's values under the
plain names, every set's under its own."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .._effects import EpochOutcome

__all__ = ["merge_sets"]

Metrics = Mapping[str, float | tuple[float, ...]]


def merge_sets(
    outcomes: Sequence[tuple[str | None, float, Metrics]], driving: str | None
) -> EpochOutcome:
    """The validation epoch's outcome from each set's ``(name, loss, metrics)``, in order.

    One unnamed source (``name`` ``None``) gives its loss and metrics as they are. Named
    sets give the loss of ``driving`` (``None``: the first set) and its metrics under their
    own names (the curve's ``validation_loss`` and ``validation_NAME``), and every set's
    loss and metrics as ``<set>_loss`` and ``<set>_NAME`` (``validation_<set>_...`` on the
    curve).
    """
    if len(outcomes) == 1 and outcomes[0][0] is None:
        _, loss, metrics = outcomes[0]
        return (loss, metrics) if metrics else loss
    chosen = driving if driving is not None else outcomes[0][0]
    merged: dict[str, float | tuple[float, ...]] = {}
    driving_loss = None
    for name, loss, metrics in outcomes:
        if name == chosen:
            driving_loss = loss
            merged |= metrics
        merged[f"{name}_loss"] = loss
        merged |= {f"{name}_{metric}": value for metric, value in metrics.items()}
    assert driving_loss is not None  # check_monitors refused a name that is no set
    return driving_loss, merged
