"""What the loop's rules watch: a reported value and the direction that is better.

The best model (``LoopOptions.best_model_monitor``), ``schedules.reduce_on_plateau`` and
:class:`EarlyStopping` each watch one value of the learning curve, named as a
:class:`~lampdist.CurvePoint` names it: ``smoothed_validation_loss`` (lamp's, the default),
``validation_loss``, ``training_loss``, or a metric as ``training_NAME`` or
``validation_NAME``; with several validation sets, also any set's values as
``validation_<set>_loss`` and ``validation_<set>_NAME``. Nothing here touches torch.
"""

from __future__ import annotations

import math
from typing import Literal

import attrs

from ._errors import ConfigError

__all__ = ["LOSSES", "EarlyStopping", "Monitor"]

LOSSES = ("smoothed_validation_loss", "validation_loss", "training_loss")
"""The learning curve's own values a monitor may name (the metrics come as prefixed names)."""
_PREFIXES = ("training_", "validation_")


def _check_metric(_: object, __: object, value: object) -> None:
    if not isinstance(value, str) or not (
        value in LOSSES or any(value.startswith(p) and len(value) > len(p) for p in _PREFIXES)
    ):
        raise ConfigError(
            f"a Monitor watches {', '.join(LOSSES)} or a metric as 'training_NAME' or "
            f"'validation_NAME', got {value!r}",
            phase="configure",
        )


def _check_mode(_: object, __: object, value: object) -> None:
    if value not in ("min", "max"):
        raise ConfigError(
            f"a Monitor's mode must be 'min' (lower is better) or 'max', got {value!r}",
            phase="configure",
        )


@attrs.frozen
class Monitor:
    """A value of the learning curve to watch and which way is better: ``mode="min"`` (a
    loss) or ``"max"`` (an accuracy).

    ``metric`` is ``"smoothed_validation_loss"`` (the default, lamp's), ``"validation_loss"``
    (raw), ``"training_loss"``, or one of the model's metrics as ``"validation_NAME"`` or
    ``"training_NAME"`` (see :attr:`lampdist.CurvePoint.metrics`), and with several
    validation sets a set's loss or metric as ``"validation_<set>_loss"`` or
    ``"validation_<set>_NAME"``::

        lampdist.Monitor("validation_accuracy", mode="max")

    A validation value counts in the epochs that validate; the others are skipped (the
    smoothed validation loss carries over them, as lamp's does). A NaN never improves on the
    best. Raises :class:`~lampdist.ConfigError` for another name or mode.
    """

    metric: str = attrs.field(default="smoothed_validation_loss", validator=_check_metric)
    mode: Literal["min", "max"] = attrs.field(default="min", validator=_check_mode)

    @property
    def validation(self) -> bool:
        """Whether the value comes from validation passes (else from training passes)."""
        return self.metric != "training_loss" and not self.metric.startswith("training_")

    def improves(self, value: float, best: float | None, *, min_delta: float = 0.0) -> bool:
        """Whether ``value`` is better than ``best`` (``None``: no value yet) by more than
        ``min_delta``; a NaN never is."""
        if self.mode == "min":
            return value + min_delta < (best if best is not None else math.inf)
        return value - min_delta > (best if best is not None else -math.inf)


def _check_patience(_: object, __: object, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"EarlyStopping.patience must be an int >= 1, got {value!r}", phase="configure"
        )


def _check_delta(_: object, __: object, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ConfigError(
            f"EarlyStopping.min_delta must be a finite number >= 0, got {value!r}",
            phase="configure",
        )


def _check_monitor(_: object, __: object, value: object) -> None:
    if not isinstance(value, Monitor):
        raise ConfigError(
            f"EarlyStopping.monitor must be a lampdist.Monitor, got {value!r}", phase="configure"
        )


@attrs.frozen(kw_only=True)
class EarlyStopping:
    """Stop the loop once ``monitor``'s value has not improved for ``patience`` epochs that
    report it (validated epochs, for a validation value), as Lightning's ``EarlyStopping``
    does: a value improves when it beats the best so far by more than ``min_delta``.

    The root then ends the loop after that epoch's checkpoint, and the followers get STOP.
    The rule's state (:class:`~lampdist.EarlyStoppingState`) lives in the loop state, so a run
    resumed from a checkpoint stops where the uninterrupted run would::

        lampdist.EarlyStopping(
            monitor=lampdist.Monitor("validation_accuracy", mode="max"), patience=5
        )

    Unlike Lightning's, a NaN does not stop the run at once: it counts as no improvement.
    Raises :class:`~lampdist.ConfigError` for ``patience < 1`` or a negative ``min_delta``.
    """

    monitor: Monitor = attrs.field(factory=Monitor, validator=_check_monitor)
    patience: int = attrs.field(default=3, validator=_check_patience)
    min_delta: float = attrs.field(default=0.0, validator=_check_delta)
