"""Learning-rate schedules: pure functions from (state, epoch, validation loss) to a factor.

A schedule tells the epoch driver, before each epoch, by what factor to multiply the
optimizer's base learning rate. A factor of 0 or less stops training. Schedules are frozen
values; the state they thread from epoch to epoch is a value made of numbers (an attrs or
dataclass value, or plain JSON), so a checkpoint can store it as JSON and rebuild it against
the run's schedule (:func:`state_to_json`, :func:`state_from_json`)::

    schedule = schedules.warmup(5, schedules.cosine(95, min_factor=0.01))
    state = schedule.init
    state, factor = schedule.learning_rate_factor(state, 0, None)

A step schedule (``StepOptions.learning_rate_per_step``) gives a factor per optimizer step
instead, from the run's global step alone: any function ``step -> factor`` (a lambda too), a
:class:`StepSchedule`, or the built-ins: warm-up then a cosine or linear decay
(:func:`warmup_cosine_steps`, :func:`warmup_linear_steps`), and the schedules of transformers
(:func:`transformers_linear_with_warmup`, :func:`transformers_cosine_with_warmup`,
:func:`transformers_constant_with_warmup`, :func:`transformers_wsd`) and torchtitan
(:func:`torchtitan_warmup_stable_decay`) bit for bit. It multiplies the epoch schedule's
factor; :func:`rate` makes one that gives the learning rate itself.

Nothing here does I/O or touches torch.
"""

from __future__ import annotations

import sys
import typing
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

import attrs

from ._library_schedules import (
    torchtitan_warmup_stable_decay,
    transformers_constant_with_warmup,
    transformers_cosine_with_warmup,
    transformers_linear_with_warmup,
    transformers_wsd,
)
from ._monitor import Monitor
from ._schedule_checks import check_float, check_int, fail
from ._schedule_json import structure, to_json
from ._stateless_schedules import (
    _Cosine,
    _Cyclic,
    _Decrement,
    _FromEpochCount,
    _Linear,
    _Noop,
    _StepAfter,
    _WarmupDecaySteps,
)
from ._step_schedules import RateSchedule, StepSchedule, _RateSteps

__all__ = [
    "LearningRateSchedule",
    "RateSchedule",
    "ReduceOnPlateauState",
    "StepSchedule",
    "WarmupState",
    "cosine",
    "cyclic",
    "decrement",
    "from_epoch_count",
    "linear",
    "noop",
    "rate",
    "reduce_on_plateau",
    "state_from_json",
    "state_to_json",
    "step_after",
    "torchtitan_warmup_stable_decay",
    "transformers_constant_with_warmup",
    "transformers_cosine_with_warmup",
    "transformers_linear_with_warmup",
    "transformers_wsd",
    "warmup",
    "warmup_cosine_steps",
    "warmup_linear_steps",
]

S = TypeVar("S")


class LearningRateSchedule(Protocol[S]):
    """A learning-rate schedule whose state between epochs has type ``S``.

    ``init`` is the state before the first epoch. The epoch driver calls
    ``learning_rate_factor(state, epoch, last_validation_loss)`` once before each epoch with
    the latest smoothed validation loss (``None`` before the first validation) and gets back
    the next state and the factor for that epoch; a factor of 0 or less stops training.
    A schedule with a ``monitor`` attribute (a :class:`lampdist.Monitor`, as
    :func:`reduce_on_plateau` has) gets the newest value of what it watches as the third
    argument instead (``None`` before the first); a schedule that wraps another forwards the
    inner one's ``monitor`` (as :func:`warmup` does). Implementations must be pure: the same
    arguments give the same result, so that resuming from a checkpointed state continues
    exactly. Implement it to plug in your own schedule; the factories of this module build
    the common ones.
    """

    @property
    def init(self) -> S:
        """The state before the first epoch."""
        ...

    def learning_rate_factor(
        self, state: S, epoch: int, last_validation_loss: float | None
    ) -> tuple[S, float]:
        """Return the next state and the learning-rate factor for ``epoch``."""
        ...


@attrs.frozen(kw_only=True)
class WarmupState(Generic[S]):
    """The state of :func:`warmup`: the wrapped schedule's state, untouched during warm-up."""

    inner: S


@attrs.frozen(kw_only=True)
class _Warmup(Generic[S]):
    steps: int
    schedule: LearningRateSchedule[S]
    start: float

    @property
    def init(self) -> WarmupState[S]:
        return WarmupState(inner=self.schedule.init)

    @property
    def monitor(self) -> Monitor | None:
        """The wrapped schedule's monitor, if it has one."""
        monitor = getattr(self.schedule, "monitor", None)
        return monitor if isinstance(monitor, Monitor) else None

    def learning_rate_factor(
        self, state: WarmupState[S], epoch: int, last_validation_loss: float | None
    ) -> tuple[WarmupState[S], float]:
        if epoch >= self.steps:
            inner, factor = self.schedule.learning_rate_factor(
                state.inner, epoch - self.steps, last_validation_loss
            )
            return WarmupState(inner=inner), factor
        # Peek at the wrapped schedule's first factor (its new state is discarded) so the
        # ramp ends where the wrapped schedule begins.
        _, first = self.schedule.learning_rate_factor(state.inner, 0, last_validation_loss)
        if epoch + 1 >= self.steps:
            return state, first
        ramp = self.start + (1.0 - self.start) * ((epoch + 1) / self.steps)
        return state, min(ramp, 1.0) * first


@attrs.frozen(kw_only=True)
class ReduceOnPlateauState:
    """The state of :func:`reduce_on_plateau`.

    ``factor`` is the current learning-rate factor, ``best_loss`` the best watched value seen
    (the lowest validation loss by default; ``None`` before the first),
    ``last_improvement_epoch`` the epoch of the last improvement or reduction (``-1`` before
    the first).
    """

    factor: float
    best_loss: float | None = None
    last_improvement_epoch: int = -1


@attrs.frozen(kw_only=True)
class _ReduceOnPlateau:
    start_factor: float
    reduce_factor: float
    patience: int
    threshold: float
    relative_threshold_mode: bool
    stop_factor: float
    monitor: Monitor = attrs.field(factory=Monitor)

    @property
    def init(self) -> ReduceOnPlateauState:
        return ReduceOnPlateauState(factor=float(self.start_factor))

    def learning_rate_factor(
        self, state: ReduceOnPlateauState, epoch: int, last_validation_loss: float | None
    ) -> tuple[ReduceOnPlateauState, float]:
        loss = last_validation_loss  # the watched value: the smoothed validation loss by default
        if loss is None:
            return state, state.factor
        # mode "max" is mode "min" on the negated values (the state keeps them as they are)
        sign = 1.0 if self.monitor.mode == "min" else -1.0
        value, best = sign * loss, None if state.best_loss is None else sign * state.best_loss
        if best is None:
            # lamp starts from Double.MaxValue: NaN and infinite losses never improve.
            improved = value < sys.float_info.max
        elif self.relative_threshold_mode:
            # lamp's best * (1 - threshold), made relative to |best| for negative losses.
            scale = 1.0 - self.threshold if best >= 0 else 1.0 + self.threshold
            improved = value < best * scale
        else:
            improved = value < best - self.threshold
        if improved:
            return attrs.evolve(state, best_loss=float(loss), last_improvement_epoch=epoch), (
                state.factor
            )
        if epoch - state.last_improvement_epoch >= self.patience:
            factor = state.factor * self.reduce_factor
            if factor <= self.stop_factor:
                factor = 0.0
            return attrs.evolve(state, factor=factor, last_improvement_epoch=epoch), factor
        return state, state.factor


def rate(fn: Callable[[int], float | Sequence[float]]) -> RateSchedule:
    """A step schedule whose ``fn(step)`` is the learning rate itself, not a factor of the
    optimizer's: pass it as ``StepOptions(learning_rate_per_step=schedules.rate(fn))``.

    Each param group's learning rate of global step ``s`` becomes ``fn(s)`` (times the epoch
    schedule's factor, 1 unless ``LoopOptions.learning_rate_schedule`` says otherwise), and
    the learning rates the optimizer was built with are ignored. ``fn`` gives one float for
    every param group, or a sequence of one float per param group (in the optimizer's
    order). One float for an optimizer whose param groups were built with different learning
    rates raises :class:`~lampdist.ConfigError` at the first step (a single rate would erase
    their ratios): give one rate per group, or a factor schedule (a plain ``step -> factor``
    function), which keeps every group's own base rate. Raises
    :class:`~lampdist.ConfigError` if ``fn`` is not callable.
    """
    if not callable(fn):
        raise fail(f"rate needs a callable step -> learning rate, got {fn!r}")
    return _RateSteps(fn)


def _warmup_decay(
    warmup_steps: int, total_steps: int, final_factor: float, shape: str
) -> StepSchedule:
    check_int("warmup_steps", warmup_steps, 0)
    check_int("total_steps", total_steps, warmup_steps + 1)
    check_float("final_factor", final_factor, low=0.0, high=1.0)
    return _WarmupDecaySteps(
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        final_factor=float(final_factor),
        shape=shape,
    )


def warmup_cosine_steps(
    warmup_steps: int, total_steps: int, final_factor: float = 0.0
) -> StepSchedule:
    """Per step: a linear warm-up over ``warmup_steps`` steps (step ``s`` gets ``(s + 1) /
    warmup_steps``), then a half-cosine from 1 down to ``final_factor`` at step
    ``total_steps``, held there after::

        (s + 1) / W                                        if s < W
        f + (1 - f) * (1 + cos(pi * (s - W) / (T - W))) / 2  if s < T
        f                                                  after

    It is torchtitan's cosine schedule since v0.1.0, bit for bit
    (:func:`torchtitan_warmup_stable_decay` ``(W, T, decay_type="cosine", min_lr_factor=f)``).
    Its warm-up is not transformers' (``s / W``: :func:`transformers_cosine_with_warmup`) nor
    older torchtitan's (``(s + 1) / (W + 1)``: ``legacy=True``); use those to match a run of
    theirs bit for bit. Raises :class:`~lampdist.ConfigError` unless
    ``0 <= warmup_steps < total_steps`` and ``0 <= final_factor <= 1``."""
    return _warmup_decay(warmup_steps, total_steps, final_factor, "cosine")


def warmup_linear_steps(
    warmup_steps: int, total_steps: int, final_factor: float = 0.0
) -> StepSchedule:
    """Per step: :func:`warmup_cosine_steps`'s warm-up, then a straight line from 1 down to
    ``final_factor`` at step ``total_steps``, held there after: ``1 + (f - 1) * (s - W) /
    (T - W)`` between. With ``final_factor=0`` it is torchtitan's linear schedule since
    v0.1.0 bit for bit; with another, equal to it up to the last bit of rounding (use
    :func:`torchtitan_warmup_stable_decay` to match it exactly)."""
    return _warmup_decay(warmup_steps, total_steps, final_factor, "linear")


def noop() -> LearningRateSchedule[None]:
    """A schedule that keeps the factor at 1 forever: the optimizer's own learning rate.

    It is the driver's default. Raises nothing.
    """
    return _Noop()


def from_epoch_count(f: Callable[[int], float]) -> LearningRateSchedule[None]:
    """A stateless schedule whose factor for epoch ``e`` is ``f(e)``.

    Use it for a closed-form schedule of your own; ``f`` must be pure for resuming to be
    exact. Raises :class:`~lampdist.ConfigError` if ``f`` is not callable.
    """
    if not callable(f):
        raise fail(f"from_epoch_count needs a callable epoch -> factor, got {f!r}")
    return _FromEpochCount(f)


def decrement(every: int, factor: float) -> LearningRateSchedule[None]:
    """Step decay: the factor for epoch ``e`` is ``factor ** (e // every)``.

    Raises :class:`~lampdist.ConfigError` unless ``every >= 1`` and ``0 < factor <= 1``.
    """
    check_int("every", every, 1)
    check_float("factor", factor, low=0.0, high=1.0, open_low=True)
    return _Decrement(every=every, factor=float(factor))


def step_after(steps: int, factor: float) -> LearningRateSchedule[None]:
    """One step: factor 1 up to epoch ``steps``, then ``factor`` for every epoch after it.

    A ``factor`` of 0 stops training after epoch ``steps``. Raises
    :class:`~lampdist.ConfigError` unless ``steps >= 0`` and ``factor >= 0`` is finite.
    """
    check_int("steps", steps, 0)
    check_float("factor", factor, low=0.0)
    return _StepAfter(steps=steps, factor=float(factor))


def linear(start: float, end: float, max_steps: int) -> LearningRateSchedule[None]:
    """Linear interpolation from ``start`` at epoch 0 to ``end`` at epoch ``max_steps``, then
    held at ``end``; rising and falling alike.

    An ``end`` of 0 stops training at epoch ``max_steps``. Raises
    :class:`~lampdist.ConfigError` unless ``start`` and ``end`` are finite and >= 0 and
    ``max_steps >= 1``.
    """
    check_float("start", start, low=0.0)
    check_float("end", end, low=0.0)
    check_int("max_steps", max_steps, 1)
    return _Linear(start=float(start), end=float(end), max_steps=max_steps)


def cyclic(max_factor: float, period: int) -> LearningRateSchedule[None]:
    """A symmetric triangle wave: each ``period`` epochs the factor goes linearly from 1 up
    to ``max_factor`` at half the period and back down to 1.

    ``max_factor`` below 1 makes the triangle dip instead. Raises
    :class:`~lampdist.ConfigError` unless ``max_factor > 0`` is finite and ``period >= 2``.
    """
    check_float("max_factor", max_factor, low=0.0, open_low=True)
    check_int("period", period, 2)
    return _Cyclic(max_factor=float(max_factor), period=period)


def cosine(max_steps: int, min_factor: float = 0.0) -> LearningRateSchedule[None]:
    """Half-cosine annealing from 1 at epoch 0 to ``min_factor`` at epoch ``max_steps``, then
    held at ``min_factor``.

    With the default ``min_factor=0`` training stops at epoch ``max_steps``. Raises
    :class:`~lampdist.ConfigError` unless ``max_steps >= 1`` and ``0 <= min_factor <= 1``.
    """
    check_int("max_steps", max_steps, 1)
    check_float("min_factor", min_factor, low=0.0, high=1.0)
    return _Cosine(max_steps=max_steps, min_factor=float(min_factor))


def warmup(
    steps: int, schedule: LearningRateSchedule[S], start: float = 0.0
) -> LearningRateSchedule[WarmupState[S]]:
    """Linear warm-up for ``steps`` epochs, then ``schedule`` with its epochs shifted by
    ``steps`` (the epoch after the warm-up is the wrapped schedule's epoch 0).

    Epoch ``e < steps`` gets ``start + (1 - start) * (e + 1) / steps`` times the wrapped
    schedule's factor for its epoch 0, so even ``start=0`` trains from the first epoch and
    the last warm-up epoch reaches the wrapped schedule's starting factor. The wrapped state
    waits in :class:`WarmupState` until the warm-up ends. Raises
    :class:`~lampdist.ConfigError` unless ``steps >= 0`` and ``0 <= start <= 1``.
    """
    check_int("steps", steps, 0)
    check_float("start", start, low=0.0, high=1.0)
    if not callable(getattr(schedule, "learning_rate_factor", None)):
        raise fail(f"warmup wraps a learning-rate schedule, got {schedule!r}")
    return _Warmup(steps=steps, schedule=schedule, start=float(start))


def reduce_on_plateau(
    *,
    start_factor: float = 1.0,
    reduce_factor: float = 0.5,
    patience: int = 10,
    threshold: float = 1e-4,
    relative_threshold_mode: bool = True,
    stop_factor: float = 1e-4,
    monitor: Monitor = Monitor(),
) -> LearningRateSchedule[ReduceOnPlateauState]:
    """Reduce the factor when the smoothed validation loss stops improving (lamp's
    ``ReduceLROnPlateau``), or the value ``monitor`` watches.

    A loss improves if it is below the best so far by more than ``threshold`` (relative:
    ``loss < best - threshold * abs(best)``; absolute: ``loss < best - threshold``). When
    ``patience`` epochs pass since the last improvement or reduction, the factor is
    multiplied by ``reduce_factor``; once it falls to ``stop_factor`` or below it becomes 0,
    which stops training. Without a validation loss yet the factor stays as it is.

    ``monitor`` watches another value of the learning curve (see :class:`lampdist.Monitor`);
    with ``mode="max"`` a value improves if it is above the best by more than the threshold
    (relative: ``value > best + threshold * abs(best)``)::

        schedules.reduce_on_plateau(
            patience=3, monitor=lampdist.Monitor("validation_accuracy", mode="max")
        )

    Raises :class:`~lampdist.ConfigError` unless ``start_factor > 0``, ``0 < reduce_factor <
    1``, ``patience >= 1``, ``threshold >= 0`` and ``stop_factor >= 0``, all finite, and
    ``monitor`` is a :class:`lampdist.Monitor`.
    """
    check_float("start_factor", start_factor, low=0.0, open_low=True)
    check_float("reduce_factor", reduce_factor, low=0.0, high=1.0, open_low=True)
    if reduce_factor == 1.0:
        raise fail("reduce_factor must be below 1, got 1; pass e.g. 0.5 to halve the factor")
    check_int("patience", patience, 1)
    check_float("threshold", threshold, low=0.0)
    check_float("stop_factor", stop_factor, low=0.0)
    if not isinstance(monitor, Monitor):
        raise fail(f"monitor must be a lampdist.Monitor, got {monitor!r}")
    return _ReduceOnPlateau(
        start_factor=float(start_factor),
        reduce_factor=float(reduce_factor),
        patience=patience,
        threshold=float(threshold),
        relative_threshold_mode=bool(relative_threshold_mode),
        stop_factor=float(stop_factor),
        monitor=monitor,
    )


def state_to_json(state: object) -> object:
    """Turn a schedule state into plain JSON data (``None``, booleans, numbers, strings, lists,
    dicts).

    Attrs and dataclass values become dicts of their fields; non-finite floats become the
    strings ``"Infinity"``, ``"-Infinity"`` and ``"NaN"`` so the result passes strict JSON
    encoders; dicts with string keys, lists and tuples are converted item by item.
    Checkpoints call it; :func:`state_from_json` reverses it. Raises
    :class:`~lampdist.ConfigError` for anything else in a state (a tensor, an object).
    """
    return to_json(state)


def state_from_json(schedule: LearningRateSchedule[S], data: object) -> S:
    """Rebuild the state of ``schedule`` from what :func:`state_to_json` returned.

    The state is rebuilt after ``schedule.init``: its type, the type annotations of its
    fields, and, for fields typed by a type variable (a wrapped schedule's state, as in
    :class:`WarmupState`), the type of the initial state's own field. Attrs and dataclass
    states come back as instances, tuples as tuples, plain JSON as it is. Raises
    :class:`~lampdist.ConfigError` if ``data`` does not fit the schedule's state (for example
    a checkpoint written with another schedule).
    """
    init = schedule.init
    return typing.cast(S, structure(type(init), init, data, schedule))
