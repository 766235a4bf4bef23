"""The pure epoch driver: effects in, :class:`LoopState` out.

It owns every loop decision (learning-rate factor, validation cadence, smoothing, best
model, checkpoints) and performs no I/O of its own: each side effect is an async callable it
is given. It runs on any async backend anyio supports.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Container, Iterable
from typing import Any, TypeGuard

import attrs

from .. import schedules
from .._effects import CheckpointLoopState, SaveBestModel, TrainEpoch, ValidationEpoch
from .._errors import ConfigError
from .._state import CurvePoint, LoopState

__all__ = ["epochs"]

logger = logging.getLogger(__name__)

_NOOP = schedules.noop()


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(message: str) -> ConfigError:
    return ConfigError(message, phase="configure")


def check_epochs_arguments(
    max_epochs: object, validation_frequency: object, smoothing: object, state: LoopState
) -> None:
    """Raise :class:`ConfigError` for arguments :func:`epochs` would refuse (for callers that
    check before they set up anything costly)."""
    if not _is_int(max_epochs) or max_epochs < 0:
        raise _fail(f"max_epochs must be an int >= 0, got {max_epochs!r}; pass e.g. max_epochs=10")
    if not _is_int(validation_frequency) or validation_frequency < 1:
        raise _fail(
            f"validation_frequency must be an int >= 1, got {validation_frequency!r}; "
            "pass 1 to validate every epoch, n to validate every n-th"
        )
    if (
        not isinstance(smoothing, int | float)
        or isinstance(smoothing, bool)
        or not 0.0 < smoothing <= 1.0
    ):
        raise _fail(
            "validation_loss_exponential_smoothing_factor must be in (0, 1], "
            f"got {smoothing!r}; pass 1.0 for no smoothing"
        )
    if not _is_int(state.epoch) or state.epoch < 0:
        raise _fail(
            f"init_state.epoch must be an int >= 0, got {state.epoch!r}; "
            "pass the LoopState a checkpoint stored"
        )


def _smooth(raw: float, previous: float | None, factor: float) -> float:
    if previous is None or factor == 1.0:
        return raw
    return factor * raw + (1.0 - factor) * previous


async def epochs(
    *,
    max_epochs: int,
    train_epoch: TrainEpoch,
    validation_epoch: ValidationEpoch | None = None,
    save_min_validation_loss_model: SaveBestModel | None = None,
    checkpoint_state: CheckpointLoopState | None = None,
    validation_frequency: int = 1,
    return_min_validation_loss_model: Container[int] | Iterable[int] = (),
    learning_rate_schedule: schedules.LearningRateSchedule[Any] = _NOOP,
    init_state: LoopState | None = None,
    learning_rate_schedule_init_state: Any = None,
    validation_loss_exponential_smoothing_factor: float = 1.0,
) -> LoopState:
    """Run epochs ``init_state.epoch, ..., max_epochs - 1`` and return the final loop state.

    Before each epoch ``e`` the schedule gives the learning-rate factor from its state, ``e``
    and the last smoothed validation loss; a factor of 0 or less stops the loop. Then
    ``train_epoch(factor)`` runs, and, when ``validation_epoch`` is given and
    ``e % validation_frequency == 0``, ``validation_epoch()``. The validation loss is
    smoothed exponentially with ``a = validation_loss_exponential_smoothing_factor``
    (``a * raw + (1 - a) * previous``; the first one is taken as it is), and the smoothed loss
    carries over epochs that are not validated. When ``e`` is in
    ``return_min_validation_loss_model`` and the smoothed loss is strictly below the lowest so
    far, ``save_min_validation_loss_model()`` runs and the minimum is recorded. Finally
    ``checkpoint_state(loop_state, lr_state)`` receives the state whose ``epoch`` is ``e + 1``
    and the schedule state after this epoch's transition: pass both back as ``init_state``
    and ``learning_rate_schedule_init_state`` to resume exactly where it left off
    (``learning_rate_schedule_init_state=None`` means the schedule's ``init``).

    The returned state's ``epoch`` is the first epoch not run. Non-finite losses are passed
    through unchanged (a NaN or infinite loss never counts as a new minimum); deciding what
    to do about them belongs to the training layer. Logs one INFO line per epoch with the
    epoch in the record's ``epoch`` attribute.

    Raises :class:`~lampdist.ConfigError` for invalid arguments (negative or non-int
    ``max_epochs``, ``validation_frequency < 1``, a smoothing factor outside (0, 1]) and
    when the schedule returns a NaN or infinite factor. Whatever an effect raises
    propagates unchanged; nothing after it runs.
    """
    state = init_state if init_state is not None else LoopState()
    check_epochs_arguments(
        max_epochs, validation_frequency, validation_loss_exponential_smoothing_factor, state
    )
    smoothing = float(validation_loss_exponential_smoothing_factor)
    save_epochs: Container[int] = (
        return_min_validation_loss_model
        if isinstance(return_min_validation_loss_model, Container)
        else frozenset(return_min_validation_loss_model)
    )
    schedule = learning_rate_schedule
    lr_state = (
        learning_rate_schedule_init_state
        if learning_rate_schedule_init_state is not None
        else schedule.init
    )

    while True:
        epoch = state.epoch
        next_lr_state, factor = schedule.learning_rate_factor(
            lr_state, epoch, state.last_validation_loss
        )
        if epoch >= max_epochs:
            logger.debug("reached max_epochs=%d", max_epochs, extra={"epoch": epoch})
            return state
        if not math.isfinite(factor):
            raise ConfigError(
                f"the learning-rate schedule returned factor {factor!r} for epoch {epoch}; "
                "return a finite factor (0 or less stops training)",
                phase="schedule",
            )
        if factor <= 0.0:
            logger.info(
                "learning-rate schedule stopped training before epoch %d (factor %g)",
                epoch,
                factor,
                extra={"epoch": epoch},
            )
            return state

        training_loss = await train_epoch(factor)

        raw: float | None = None
        smoothed: float | None = None
        last_validation_loss = state.last_validation_loss
        min_validation_loss = state.min_validation_loss
        min_validation_epoch = state.min_validation_epoch
        if validation_epoch is not None and epoch % validation_frequency == 0:
            raw = await validation_epoch()
            smoothed = _smooth(raw, last_validation_loss, smoothing)
            last_validation_loss = smoothed
            lowest = min_validation_loss if min_validation_loss is not None else math.inf
            if epoch in save_epochs and smoothed < lowest:
                if save_min_validation_loss_model is not None:
                    await save_min_validation_loss_model()
                min_validation_loss = smoothed
                min_validation_epoch = epoch

        state = attrs.evolve(
            state,
            epoch=epoch + 1,
            last_validation_loss=last_validation_loss,
            min_validation_loss=min_validation_loss,
            min_validation_epoch=min_validation_epoch,
            learning_curve=(
                *state.learning_curve,
                CurvePoint(
                    epoch=epoch,
                    training_loss=training_loss,
                    validation_loss=raw,
                    smoothed_validation_loss=smoothed,
                ),
            ),
        )
        logger.info(
            "epoch %d: training loss %.6g, validation loss %s, smoothed %s, lr factor %.6g",
            epoch,
            training_loss,
            "-" if raw is None else f"{raw:.6g}",
            "-" if smoothed is None else f"{smoothed:.6g}",
            factor,
            extra={"epoch": epoch},
        )
        if checkpoint_state is not None:
            await checkpoint_state(state, next_lr_state)
        lr_state = next_lr_state
