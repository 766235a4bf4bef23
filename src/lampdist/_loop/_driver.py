"""The pure epoch driver: effects in, :class:`LoopState` out.

It owns every loop decision (learning-rate factor, validation cadence, smoothing, best
model, early stopping, checkpoints) and performs no I/O of its own: each side effect is an
async callable it is given. It runs on any async backend anyio supports.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Container, Iterable, Mapping
from typing import Any, Protocol, TypeGuard

import attrs

from .. import schedules
from .._effects import CheckpointLoopState, SaveBestModel, TrainEpoch, ValidationEpoch
from .._errors import ConfigError
from .._monitor import LOSSES, EarlyStopping, Monitor
from .._state import CurvePoint, EarlyStoppingState, LoopState

__all__ = ["EpochEffects", "EpochRules", "epochs", "run_epochs"]

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
    """The newest value of ``monitor``'s metric in ``curve`` (``None`` before the first; the
    validation before training does not count)."""
    for point in reversed(tuple(curve)):
        if point.epoch < 0:
            break
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
    validate_before_training: bool = False,
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

    With ``validate_before_training`` (and ``validation_epoch``), a new run (``init_state``
    at epoch 0 with an empty learning curve) first awaits ``validation_epoch()`` once and
    records it as the curve's point of epoch ``-1`` (``training_loss`` NaN, no smoothed
    loss): a measurement of the model before training, which feeds neither the smoothing,
    the best model, early stopping nor the schedule. A resumed run does not repeat it.

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
    rules = _Rules(
        max_epochs=max_epochs,
        validation_frequency=validation_frequency,
        validation_loss_exponential_smoothing_factor=validation_loss_exponential_smoothing_factor,
        learning_rate_schedule=learning_rate_schedule,
        return_min_validation_loss_model=return_min_validation_loss_model,
        best_model_monitor=best_model_monitor,
        early_stopping=early_stopping,
        validate_before_training=validate_before_training,
    )
    effects = EpochEffects(
        train_epoch=train_epoch,
        validation_epoch=validation_epoch,
        save_min_validation_loss_model=save_min_validation_loss_model,
        checkpoint_state=checkpoint_state,
    )
    return await run_epochs(
        rules, effects, init_state=init_state, lr_state=learning_rate_schedule_init_state
    )


class EpochRules(Protocol):
    """The epoch loop's rules, as :func:`epochs` takes them (``LoopOptions`` is one)."""

    @property
    def max_epochs(self) -> int: ...
    @property
    def validation_frequency(self) -> int: ...
    @property
    def validation_loss_exponential_smoothing_factor(self) -> float: ...
    @property
    def learning_rate_schedule(self) -> schedules.LearningRateSchedule[Any]: ...
    @property
    def return_min_validation_loss_model(self) -> Container[int] | Iterable[int]: ...
    @property
    def best_model_monitor(self) -> Monitor: ...
    @property
    def early_stopping(self) -> EarlyStopping | None: ...
    @property
    def validate_before_training(self) -> bool: ...


@attrs.frozen(kw_only=True)
class _Rules:
    """:class:`EpochRules` from :func:`epochs`'s arguments."""

    max_epochs: int
    validation_frequency: int
    validation_loss_exponential_smoothing_factor: float
    learning_rate_schedule: schedules.LearningRateSchedule[Any]
    return_min_validation_loss_model: Container[int] | Iterable[int]
    best_model_monitor: Monitor
    early_stopping: EarlyStopping | None
    validate_before_training: bool = False


@attrs.frozen(kw_only=True)
class EpochEffects:
    """What the epoch loop awaits: the passes, the best model's save, the checkpoint."""

    train_epoch: TrainEpoch
    validation_epoch: ValidationEpoch | None = None
    save_min_validation_loss_model: SaveBestModel | None = None
    checkpoint_state: CheckpointLoopState | None = None


@attrs.frozen
class _Loop:
    """One run of the loop: its rules, effects and what it derives from them once."""

    rules: EpochRules
    effects: EpochEffects
    smoothing: float
    save_epochs: Container[int]
    schedule_monitor: Monitor | None

    @classmethod
    def create(cls, rules: EpochRules, effects: EpochEffects, state: LoopState) -> _Loop:
        smoothing = rules.validation_loss_exponential_smoothing_factor
        _check_arguments(rules.max_epochs, rules.validation_frequency, smoothing, state)
        best = rules.return_min_validation_loss_model
        save_epochs = best if isinstance(best, Container) else frozenset(best)
        early_stopping = rules.early_stopping
        validates = effects.validation_epoch is not None
        if early_stopping is not None and early_stopping.monitor.validation and not validates:
            raise _fail(
                f"early stopping watches {early_stopping.monitor.metric!r}, but the loop does "
                "not validate: pass validation_epoch (validation_batches) or watch a training "
                "value"
            )
        monitor = _schedule_monitor(rules.learning_rate_schedule)
        return cls(rules, effects, float(smoothing), save_epochs, monitor)


async def run_epochs(
    rules: EpochRules,
    effects: EpochEffects,
    *,
    init_state: LoopState | None = None,
    lr_state: Any = None,
    stop: Callable[[], bool] | None = None,
) -> LoopState:
    """The loop of :func:`epochs`, its rules and effects whole; ``stop`` (when given) is
    asked before each epoch whether a stop was requested: the loop then ends before it, as
    it does at ``max_epochs`` (the schedule is not asked)."""
    state = init_state if init_state is not None else LoopState()
    loop = _Loop.create(rules, effects, state)
    schedule = rules.learning_rate_schedule
    lr_state = lr_state if lr_state is not None else schedule.init
    if _validates_first(loop, state):
        state = await _validate_first(loop, state)
    while True:
        epoch = state.epoch
        stopped = stop is not None and stop()
        if stopped:
            next_lr_state, factor = lr_state, 0.0
        else:
            watched = (
                state.last_validation_loss
                if loop.schedule_monitor is None
                else _latest(state.learning_curve, loop.schedule_monitor)
            )
            next_lr_state, factor = schedule.learning_rate_factor(lr_state, epoch, watched)
        if _ends_before(loop, state, factor, stopped=stopped):
            return state
        state = await _one_epoch(loop, state, factor)
        if effects.checkpoint_state is not None:
            await effects.checkpoint_state(state, next_lr_state)
        lr_state = next_lr_state


def _validates_first(loop: _Loop, state: LoopState) -> bool:
    """Whether the loop validates before training: asked to, and a new run."""
    first = state.epoch == 0 and not state.learning_curve
    validates = loop.effects.validation_epoch is not None
    return loop.rules.validate_before_training and validates and first


async def _validate_first(loop: _Loop, state: LoopState) -> LoopState:
    """The validation before training, as the curve's point of epoch ``state.epoch - 1``."""
    assert loop.effects.validation_epoch is not None
    outcome = await loop.effects.validation_epoch()
    raw, metrics = _outcome(outcome, "validation_epoch")
    point = CurvePoint(
        epoch=state.epoch - 1,
        training_loss=math.nan,
        validation_loss=raw,
        metrics={f"validation_{name}": value for name, value in metrics.items()},
    )
    logger.info("before training: validation loss %.6g", raw, extra={"epoch": point.epoch})
    return attrs.evolve(state, learning_curve=(*state.learning_curve, point))


def _ends_before(loop: _Loop, state: LoopState, factor: float, *, stopped: bool) -> bool:
    """Whether the loop ends before epoch ``state.epoch``: ``max_epochs``, early stopping,
    a stop requested, the schedule's factor of 0 or less; raises :class:`ConfigError` for a
    factor that is not finite."""
    epoch, rules = state.epoch, loop.rules
    if epoch >= rules.max_epochs:
        logger.debug("reached max_epochs=%d", rules.max_epochs, extra={"epoch": epoch})
        return True
    early_stopping = rules.early_stopping
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
        return True
    if stopped:
        logger.info("stopping on request before epoch %d", epoch, extra={"epoch": epoch})
        return True
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
        return True
    return False


async def _one_epoch(loop: _Loop, state: LoopState, factor: float) -> LoopState:
    """Train epoch ``state.epoch`` (and validate it when due), record its point of the
    curve, the best model and early stopping; the loop state after it."""
    epoch, rules, effects = state.epoch, loop.rules, loop.effects
    training_loss, training_metrics = _outcome(await effects.train_epoch(factor), "train_epoch")
    metrics = {f"training_{name}": value for name, value in training_metrics.items()}
    raw: float | None = None
    smoothed: float | None = None
    last_validation_loss = state.last_validation_loss
    if effects.validation_epoch is not None and epoch % rules.validation_frequency == 0:
        outcome = await effects.validation_epoch()
        raw, validation_metrics = _outcome(outcome, "validation_epoch")
        metrics |= {f"validation_{name}": value for name, value in validation_metrics.items()}
        smoothed = _smooth(raw, last_validation_loss, loop.smoothing)
        last_validation_loss = smoothed
    point = CurvePoint(
        epoch=epoch,
        training_loss=training_loss,
        validation_loss=raw,
        smoothed_validation_loss=smoothed,
        metrics=metrics,
    )
    if loop.schedule_monitor is not None:  # before the next epoch's schedule call needs it
        _watched(point, loop.schedule_monitor, "the learning-rate schedule", check=True)
    min_validation_loss, min_validation_epoch = await _best(loop, state, point)
    early = state.early_stopping
    if rules.early_stopping is not None:
        value = _watched(point, rules.early_stopping.monitor, "early stopping", check=True)
        early = _early_stopping_state(rules.early_stopping, early, value)
    logger.info(
        "epoch %d: training loss %.6g, validation loss %s, smoothed %s, lr factor %.6g",
        epoch,
        training_loss,
        "-" if raw is None else f"{raw:.6g}",
        "-" if smoothed is None else f"{smoothed:.6g}",
        factor,
        extra={"epoch": epoch},
    )
    return attrs.evolve(
        state,
        epoch=epoch + 1,
        last_validation_loss=last_validation_loss,
        min_validation_loss=min_validation_loss,
        min_validation_epoch=min_validation_epoch,
        learning_curve=(*state.learning_curve, point),
        early_stopping=early,
    )


async def _best(
    loop: _Loop, state: LoopState, point: CurvePoint
) -> tuple[float | None, int | None]:
    """The best model's watched value and epoch after ``point``'s epoch, saving the model
    when the epoch is one to save at and improves on the best."""
    best_so_far = state.min_validation_loss, state.min_validation_epoch
    if point.epoch not in loop.save_epochs:
        return best_so_far
    monitor = loop.rules.best_model_monitor
    best = _watched(point, monitor, "the best model", check=True)
    if best is None or not monitor.improves(best, state.min_validation_loss):
        return best_so_far
    save = loop.effects.save_min_validation_loss_model
    if save is not None:
        await save()
    return best, point.epoch
