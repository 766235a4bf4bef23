"""The pure epoch driver: effects in, :class:`LoopState` out.

It owns every loop decision (learning-rate factor, validation cadence, smoothing, best
model, early stopping, checkpoints) and performs no I/O of its own: each side effect is an
async callable it is given. It runs on any async backend anyio supports.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Container, Iterable, Mapping
from typing import Any, TypeGuard

import attrs

from .. import schedules
from .._effects import CheckpointLoopState, SaveBestModel, TrainEpoch, ValidationEpoch
from .._errors import ConfigError
from .._monitor import LOSSES, EarlyStopping, Monitor
from .._state import CurvePoint, EarlyStoppingState, LoopState

__all__ = ["epochs"]

logger = logging.getLogger(__name__)

_NOOP = schedules.noop()
_DEFAULT_MONITOR = Monitor()

Metrics = Mapping[str, float | tuple[float, ...]]


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(message: str) -> ConfigError:
    return ConfigError(message, phase="configure")


def check_max_epochs(value: object, name: str = "max_epochs") -> None:
    """Raise :class:`ConfigError` unless ``value`` is an int >= 0; the message calls it
    ``name`` (so do the other checks of an argument)."""
    if not _is_int(value) or value < 0:
        raise _fail(f"{name} must be an int >= 0, got {value!r}; pass e.g. max_epochs=10")


def check_validation_frequency(value: object, name: str = "validation_frequency") -> None:
    """Raise :class:`ConfigError` unless ``value`` is an int >= 1."""
    if not _is_int(value) or value < 1:
        raise _fail(
            f"{name} must be an int >= 1, got {value!r}; "
            "pass 1 to validate every epoch, n to validate every n-th"
        )


def check_smoothing(
    value: object, name: str = "validation_loss_exponential_smoothing_factor"
) -> None:
    """Raise :class:`ConfigError` unless ``value`` is a number in (0, 1]."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0.0 < value <= 1.0:
        raise _fail(f"{name} must be in (0, 1], got {value!r}; pass 1.0 for no smoothing")


def _check_arguments(
    max_epochs: object, validation_frequency: object, smoothing: object, state: LoopState
) -> None:
    """Raise :class:`ConfigError` for arguments :func:`epochs` refuses."""
    check_max_epochs(max_epochs)
    check_validation_frequency(validation_frequency)
    check_smoothing(smoothing)
    if not _is_int(state.epoch) or state.epoch < 0:
        raise _fail(
            f"init_state.epoch must be an int >= 0, got {state.epoch!r}; "
            "pass the LoopState a checkpoint stored"
        )


def _smooth(raw: float, previous: float | None, factor: float) -> float:
    if previous is None or factor == 1.0:
        return raw
    return factor * raw + (1.0 - factor) * previous


def _outcome(value: object, effect: str) -> tuple[float, Metrics]:
    """An epoch effect's result as (mean loss, metrics): a float, or a (float, mapping)."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], Mapping):
        return value[0], value[1]
    if isinstance(value, tuple):
        raise ConfigError(
            f"{effect} returned {value!r}; return the mean loss, or (mean loss, metrics) with "
            "the metrics a mapping of names to floats",
            phase="loop",
        )
    return value, {}  # type: ignore[return-value]  # a float, as the effect type says


def _schedule_monitor(schedule: object) -> Monitor | None:
    """The monitor of a schedule that watches something other than lamp's value (the
    smoothed validation loss): its ``monitor`` attribute, forwarded by wrappers."""
    monitor = getattr(schedule, "monitor", None)
    if not isinstance(monitor, Monitor) or monitor.metric == _DEFAULT_MONITOR.metric:
        return None
    return monitor


def _latest(curve: Iterable[CurvePoint], monitor: Monitor) -> float | None:
    """The newest value of ``monitor``'s metric in ``curve`` (``None`` before the first)."""
    for point in reversed(tuple(curve)):
        value = _watched(point, monitor, "the learning-rate schedule", check=False)
        if value is not None:
            return value
    return None


def _watched(point: CurvePoint, monitor: Monitor, watcher: str, *, check: bool) -> float | None:
    """The value ``monitor`` watches in ``point``, or ``None`` when the epoch did not report
    it (a validation value of an epoch not validated). With ``check``, a name the epoch
    should have reported and did not is a :class:`ConfigError`, and so is a vector."""
    name = monitor.metric
    if name in LOSSES:
        loss: float | None = getattr(point, name)
        return loss
    reported = point.validation_loss is not None if monitor.validation else True
    value = point.metrics.get(name)
    if value is None:
        if check and reported:
            known = ", ".join([*LOSSES, *sorted(point.metrics)])
            raise ConfigError(
                f"{watcher} watches {name!r}, which epoch {point.epoch} did not report "
                f"(it reported {known}); name a metric of SupervisedModel.metrics as "
                "'training_NAME' or 'validation_NAME'",
                phase="loop",
            )
        return None
    if isinstance(value, tuple):
        raise ConfigError(
            f"{watcher} watches {name!r}, which has {len(value)} values; watch a scalar metric",
            phase="loop",
        )
    return value


def _stops_early(rule: EarlyStopping | None, state: LoopState) -> bool:
    stopping = state.early_stopping
    return rule is not None and stopping is not None and stopping.wait >= rule.patience


def _early_stopping_state(
    rule: EarlyStopping, state: EarlyStoppingState | None, value: float | None
) -> EarlyStoppingState:
    """The rule's state after an epoch whose watched value is ``value`` (``None``: the epoch
    did not report it, and does not count)."""
    state = state if state is not None else EarlyStoppingState()
    if value is None:
        return state
    if rule.monitor.improves(value, state.best, min_delta=rule.min_delta):
        return EarlyStoppingState(best=value, wait=0)
    return attrs.evolve(state, wait=state.wait + 1)


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
    best_model_monitor: Monitor = _DEFAULT_MONITOR,
    early_stopping: EarlyStopping | None = None,
) -> LoopState:
    """Run epochs ``init_state.epoch, ..., max_epochs - 1`` and return the final loop state.

    Before each epoch ``e`` the schedule gives the learning-rate factor from its state, ``e``
    and the last smoothed validation loss (or, for a schedule with a ``monitor``, such as
    ``reduce_on_plateau(monitor=...)``, the newest value of what it watches); a factor of 0
    or less stops the loop, and so does ``early_stopping`` once its watched value has not
    improved for ``patience`` epochs that reported it. Then
    ``train_epoch(factor)`` runs, and, when ``validation_epoch`` is given and
    ``e % validation_frequency == 0``, ``validation_epoch()``; each returns its mean loss, or
    ``(mean loss, metrics)`` with the pass's metrics, which the learning curve records as
    ``training_NAME`` and ``validation_NAME``. The validation loss is
    smoothed exponentially with ``a = validation_loss_exponential_smoothing_factor``
    (``a * raw + (1 - a) * previous``; the first one is taken as it is), and the smoothed loss
    carries over epochs that are not validated. When ``e`` is in
    ``return_min_validation_loss_model`` and the value ``best_model_monitor`` watches (by
    default the smoothed validation loss, lower is better) is strictly better than the best
    so far, ``save_min_validation_loss_model()`` runs and the best is recorded
    (``min_validation_loss``, ``min_validation_epoch``). Finally
    ``checkpoint_state(loop_state, lr_state)`` receives the state whose ``epoch`` is ``e + 1``
    and the schedule state after this epoch's transition: pass both back as ``init_state``
    and ``learning_rate_schedule_init_state`` to resume exactly where it left off
    (``learning_rate_schedule_init_state=None`` means the schedule's ``init``); the
    early-stopping state travels in the loop state.

    The returned state's ``epoch`` is the first epoch not run. Non-finite losses are passed
    through unchanged (a NaN or infinite loss never counts as a new minimum); deciding what
    to do about them belongs to the training layer. Logs one INFO line per epoch with the
    epoch in the record's ``epoch`` attribute.

    Raises :class:`~lampdist.ConfigError` for invalid arguments (negative or non-int
    ``max_epochs``, ``validation_frequency < 1``, a smoothing factor outside (0, 1], early
    stopping on a validation value without ``validation_epoch``), when the schedule returns
    a NaN or infinite factor, and when a monitor names a value that an epoch did not report
    or that is not a scalar. Whatever an effect raises propagates unchanged; nothing after
    it runs.
    """
    state = init_state if init_state is not None else LoopState()
    _check_arguments(
        max_epochs, validation_frequency, validation_loss_exponential_smoothing_factor, state
    )
    smoothing = float(validation_loss_exponential_smoothing_factor)
    save_epochs: Container[int] = (
        return_min_validation_loss_model
        if isinstance(return_min_validation_loss_model, Container)
        else frozenset(return_min_validation_loss_model)
    )
    validates = validation_epoch is not None
    if early_stopping is not None and early_stopping.monitor.validation and not validates:
        raise _fail(
            f"early stopping watches {early_stopping.monitor.metric!r}, but the loop does not "
            "validate: pass validation_epoch (validation_batches) or watch a training value"
        )
    schedule = learning_rate_schedule
    schedule_monitor = _schedule_monitor(schedule)
    lr_state = (
        learning_rate_schedule_init_state
        if learning_rate_schedule_init_state is not None
        else schedule.init
    )

    while True:
        epoch = state.epoch
        watched = (
            state.last_validation_loss
            if schedule_monitor is None
            else _latest(state.learning_curve, schedule_monitor)
        )
        next_lr_state, factor = schedule.learning_rate_factor(lr_state, epoch, watched)
        if epoch >= max_epochs:
            logger.debug("reached max_epochs=%d", max_epochs, extra={"epoch": epoch})
            return state
        if _stops_early(early_stopping, state):
            assert early_stopping is not None and state.early_stopping is not None
            logger.info(
                "early stopping before epoch %d: %s has not improved on %s for %d epochs",
                epoch,
                early_stopping.monitor.metric,
                state.early_stopping.best,
                state.early_stopping.wait,
                extra={"epoch": epoch},
            )
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

        training_loss, training_metrics = _outcome(await train_epoch(factor), "train_epoch")
        metrics = {f"training_{name}": value for name, value in training_metrics.items()}

        raw: float | None = None
        smoothed: float | None = None
        last_validation_loss = state.last_validation_loss
        min_validation_loss = state.min_validation_loss
        min_validation_epoch = state.min_validation_epoch
        if validation_epoch is not None and epoch % validation_frequency == 0:
            raw, validation_metrics = _outcome(await validation_epoch(), "validation_epoch")
            metrics |= {f"validation_{name}": value for name, value in validation_metrics.items()}
            smoothed = _smooth(raw, last_validation_loss, smoothing)
            last_validation_loss = smoothed
        point = CurvePoint(
            epoch=epoch,
            training_loss=training_loss,
            validation_loss=raw,
            smoothed_validation_loss=smoothed,
            metrics=metrics,
        )
        if schedule_monitor is not None:  # before the next epoch's schedule call needs it
            _watched(point, schedule_monitor, "the learning-rate schedule", check=True)
        if epoch in save_epochs:
            best = _watched(point, best_model_monitor, "the best model", check=True)
            if best is not None and best_model_monitor.improves(best, min_validation_loss):
                if save_min_validation_loss_model is not None:
                    await save_min_validation_loss_model()
                min_validation_loss = best
                min_validation_epoch = epoch
        early = state.early_stopping
        if early_stopping is not None:
            value = _watched(point, early_stopping.monitor, "early stopping", check=True)
            early = _early_stopping_state(early_stopping, early, value)

        state = attrs.evolve(
            state,
            epoch=epoch + 1,
            last_validation_loss=last_validation_loss,
            min_validation_loss=min_validation_loss,
            min_validation_epoch=min_validation_epoch,
            learning_curve=(*state.learning_curve, point),
            early_stopping=early,
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
