"""Learning-rate schedules: ranges, shapes, composition, lamp's plateau rule, JSON states."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lampdist
from lampdist import schedules
from lampdist.schedules import LearningRateSchedule

moderate = settings(max_examples=100, deadline=None)

EPOCHS = st.integers(min_value=0, max_value=10_000)
LOSS = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)
LOSSES = st.lists(st.none() | LOSS, max_size=40)


def run(
    schedule: LearningRateSchedule[Any],
    losses: Sequence[float | None],
    *,
    first_epoch: int = 0,
    state: Any = None,
) -> tuple[list[float], list[Any]]:
    """Thread the state through one call per epoch; return the factors and the states."""
    state = schedule.init if state is None else state
    factors: list[float] = []
    states: list[Any] = [state]
    for offset, loss in enumerate(losses):
        state, factor = schedule.learning_rate_factor(state, first_epoch + offset, loss)
        factors.append(factor)
        states.append(state)
    return factors, states


def factor_at(schedule: LearningRateSchedule[None], epoch: int) -> float:
    return schedule.learning_rate_factor(None, epoch, None)[1]


def test_all_is_sorted_and_documented() -> None:
    assert schedules.__all__ == sorted(schedules.__all__)
    for name in schedules.__all__:
        assert getattr(schedules, name).__doc__, name


def test_the_state_classes_are_named_by_the_public_module() -> None:
    """A checkpoint records the type of the schedule state by its module and name
    (``lampdist.schedules.WarmupState``), and the reprs of schedules name their classes: both
    stay what they were wherever the implementation lives."""
    for cls in (schedules.WarmupState, schedules.ReduceOnPlateauState):
        assert f"{cls.__module__}.{cls.__qualname__}" == f"lampdist.schedules.{cls.__name__}"
    schedule = schedules.warmup(2, schedules.reduce_on_plateau(patience=3))
    assert repr(schedule).startswith("_Warmup(steps=2, schedule=_ReduceOnPlateau(start_factor=1.0")
    assert repr(schedules.cosine(4)) == "_Cosine(max_steps=4, min_factor=0.0)"
    assert repr(schedules.warmup_linear_steps(1, 3)) == (
        "_WarmupDecaySteps(warmup_steps=1, total_steps=3, final_factor=0.0, shape='linear')"
    )


# --- reduce_on_plateau ----------------------------------------------------------------------


def test_reduce_on_plateau_follows_lamps_own_test_exactly() -> None:
    schedule = schedules.reduce_on_plateau(stop_factor=0.1)
    steps = [
        (0, 10.0, 1.0),
        (1, 10.0, 1.0),
        (9, 10.0, 1.0),
        (10, 10.0, 0.5),
        (18, 11.0, 0.5),
        (19, 9.0, 0.5),
        (28, 9.0 - 1e-6, 0.5),
        (29, 9.0 - 1e-6, 0.25),
        (39, 9.0 - 1e-6, 0.125),
        (50, 9.0 - 1e-6, 0.0),
    ]
    state = schedule.init
    for epoch, loss, expected in steps:
        state, factor = schedule.learning_rate_factor(state, epoch, loss)
        assert factor == expected, (epoch, loss)


@moderate
@given(
    start=st.floats(min_value=0.01, max_value=10),
    reduce=st.floats(min_value=0.05, max_value=0.95),
    patience=st.integers(min_value=1, max_value=5),
    stop=st.floats(min_value=0, max_value=0.5),
    relative=st.booleans(),
    losses=LOSSES,
)
def test_reduce_on_plateau_only_ever_reduces_by_its_factor(
    *,
    start: float,
    reduce: float,
    patience: int,
    stop: float,
    relative: bool,
    losses: list[float | None],
) -> None:
    schedule = schedules.reduce_on_plateau(
        start_factor=start,
        reduce_factor=reduce,
        patience=patience,
        stop_factor=stop,
        relative_threshold_mode=relative,
    )
    factors, states = run(schedule, losses)
    previous = start
    for loss, factor, before, after in zip(losses, factors, states[:-1], states[1:], strict=True):
        assert factor in (previous, previous * reduce, 0.0)
        assert factor <= previous
        assert factor in (0.0, start) or factor > stop
        if previous == 0.0:
            assert factor == 0.0
        if loss is None:
            assert (after, factor) == (before, before.factor)
        previous = factor


@moderate
@given(
    patience=st.integers(min_value=1, max_value=6),
    reduce=st.floats(min_value=0.1, max_value=0.9),
    loss=st.floats(min_value=-100, max_value=100),
    epochs=st.integers(min_value=1, max_value=60),
)
def test_reduce_on_plateau_on_a_flat_loss_is_a_step_decay(
    patience: int, reduce: float, loss: float, epochs: int
) -> None:
    schedule = schedules.reduce_on_plateau(reduce_factor=reduce, patience=patience, stop_factor=0)
    factors, _ = run(schedule, [loss] * epochs)
    expected = [1.0]
    for _ in range(1, epochs):
        expected.append(expected[-1] * reduce if len(expected) % patience == 0 else expected[-1])
    assert factors == expected


@moderate
@given(epochs=st.integers(min_value=1, max_value=60), relative=st.booleans())
def test_reduce_on_plateau_never_reduces_while_the_loss_keeps_improving(
    epochs: int, relative: bool
) -> None:
    schedule = schedules.reduce_on_plateau(patience=1, relative_threshold_mode=relative)
    factors, _ = run(schedule, [1000.0 - 10.0 * e for e in range(epochs)])
    assert factors == [1.0] * epochs


def test_reduce_on_plateau_threshold_modes() -> None:
    relative = schedules.reduce_on_plateau(patience=1, threshold=0.1)
    absolute = schedules.reduce_on_plateau(patience=1, threshold=0.1, relative_threshold_mode=False)
    # 9.5 is 0.5 below 10: an absolute improvement, not a 10 % relative one.
    assert run(relative, [10.0, 9.5])[0] == [1.0, 0.5]
    assert run(absolute, [10.0, 9.5])[0] == [1.0, 1.0]


def test_reduce_on_plateau_without_a_loss_keeps_its_factor() -> None:
    schedule = schedules.reduce_on_plateau(start_factor=0.3, patience=1)
    factors, states = run(schedule, [None] * 5)
    assert factors == [0.3] * 5
    assert states == [schedule.init] * 6


def test_reduce_on_plateau_never_takes_nan_or_infinity_as_best() -> None:
    schedule = schedules.reduce_on_plateau(patience=2)
    _, states = run(schedule, [math.nan, math.inf, 5.0])
    assert [s.best_loss for s in states] == [None, None, None, 5.0]
    assert states[-1].last_improvement_epoch == 2


# --- stateless schedules --------------------------------------------------------------------


@moderate
@given(
    every=st.integers(min_value=1, max_value=20),
    factor=st.floats(min_value=0.01, max_value=1),
    epoch=st.integers(min_value=0, max_value=200),
)
def test_decrement_is_a_power_of_its_factor(every: int, factor: float, epoch: int) -> None:
    schedule = schedules.decrement(every, factor)
    value = factor_at(schedule, epoch)
    assert value == factor ** (epoch // every)
    assert 0 < value <= 1 or value == 0.0
    assert factor_at(schedule, epoch + 1) <= value


@moderate
@given(
    steps=st.integers(min_value=0, max_value=50),
    factor=st.floats(min_value=0, max_value=10),
    epoch=EPOCHS,
)
def test_step_after_switches_once_past_steps(steps: int, factor: float, epoch: int) -> None:
    assert factor_at(schedules.step_after(steps, factor), epoch) == (
        factor if epoch > steps else 1.0
    )


@moderate
@given(
    start=st.floats(min_value=0, max_value=10),
    end=st.floats(min_value=0, max_value=10),
    max_steps=st.integers(min_value=1, max_value=500),
)
def test_linear_goes_from_start_to_end_rising_or_falling(
    start: float, end: float, max_steps: int
) -> None:
    schedule = schedules.linear(start, end, max_steps)
    values = [factor_at(schedule, e) for e in range(max_steps + 3)]
    assert values[0] == start
    assert values[max_steps:] == [end] * 3
    assert all(min(start, end) <= v <= max(start, end) for v in values)
    pairs = list(itertools.pairwise(values))
    if end >= start:
        assert all(a <= b for a, b in pairs)
    else:
        assert all(a >= b for a, b in pairs)
    middle = factor_at(schedule, max_steps // 2)
    assert middle == pytest.approx(start + (end - start) * (max_steps // 2) / max_steps)


def test_linear_rises_where_lamp_held_it_flat() -> None:
    schedule = schedules.linear(0.1, 1.0, 10)
    assert [factor_at(schedule, e) for e in (0, 5, 10, 20)] == pytest.approx([0.1, 0.55, 1, 1])


@moderate
@given(
    max_factor=st.floats(min_value=0.01, max_value=20),
    period=st.integers(min_value=2, max_value=100),
    epoch=st.integers(min_value=0, max_value=1000),
)
def test_cyclic_is_a_symmetric_periodic_triangle(
    max_factor: float, period: int, epoch: int
) -> None:
    schedule = schedules.cyclic(max_factor, period)
    value = factor_at(schedule, epoch)
    phase = epoch % period
    assert min(1.0, max_factor) <= value <= max(1.0, max_factor)
    assert value == factor_at(schedule, epoch + period)
    assert value == factor_at(schedule, (period - phase) % period)
    assert factor_at(schedule, 0) == 1.0
    if period % 2 == 0:
        assert factor_at(schedule, period // 2) == max_factor
    rising = [factor_at(schedule, e) for e in range(period // 2 + 1)]
    pairs = list(itertools.pairwise(rising))
    assert all(a <= b for a, b in pairs) if max_factor >= 1 else all(a >= b for a, b in pairs)
    assert value == pytest.approx(1 + (max_factor - 1) * (1 - abs(2 * phase - period) / period))


@moderate
@given(
    max_steps=st.integers(min_value=1, max_value=500),
    min_factor=st.floats(min_value=0, max_value=1),
)
def test_cosine_falls_from_one_to_min_factor_and_holds(max_steps: int, min_factor: float) -> None:
    schedule = schedules.cosine(max_steps, min_factor)
    values = [factor_at(schedule, e) for e in range(max_steps + 3)]
    assert values[0] == 1.0
    assert values[max_steps:] == [min_factor] * 3
    assert all(min_factor <= v <= 1.0 for v in values)
    assert all(a >= b for a, b in itertools.pairwise(values))
    half = factor_at(schedule, max_steps // 2)
    phase = math.pi * (max_steps // 2) / max_steps
    assert half == pytest.approx(min_factor + (1 - min_factor) * (1 + math.cos(phase)) / 2)


@moderate
@given(epoch=EPOCHS, loss=st.none() | LOSS)
def test_noop_and_from_epoch_count(epoch: int, loss: float | None) -> None:
    assert schedules.noop().learning_rate_factor(None, epoch, loss) == (None, 1.0)
    schedule = schedules.from_epoch_count(lambda e: 1.0 / (e + 1))
    assert schedule.init is None
    assert schedule.learning_rate_factor(None, epoch, loss) == (None, 1.0 / (epoch + 1))


# --- warmup ---------------------------------------------------------------------------------

INNER: list[LearningRateSchedule[Any]] = [
    schedules.noop(),
    schedules.decrement(3, 0.5),
    schedules.linear(0.2, 1.0, 7),
    schedules.reduce_on_plateau(patience=2, stop_factor=0.01),
    schedules.warmup(2, schedules.cosine(9, 0.1), start=0.5),
]


@moderate
@given(
    inner=st.sampled_from(INNER),
    steps=st.integers(min_value=0, max_value=8),
    start=st.floats(min_value=0, max_value=1),
    losses=LOSSES,
)
def test_warmup_ramps_then_hands_over_with_shifted_epochs(
    inner: LearningRateSchedule[Any], steps: int, start: float, losses: list[float | None]
) -> None:
    schedule = schedules.warmup(steps, inner, start=start)
    factors, states = run(schedule, losses)
    # During warm-up the wrapped state waits untouched.
    assert all(s.inner == inner.init for s in states[: min(steps, len(losses)) + 1])
    first_inner = [inner.learning_rate_factor(inner.init, 0, loss)[1] for loss in losses]
    for epoch, factor in enumerate(factors[:steps]):
        ramp = start + (1 - start) * (epoch + 1) / steps
        assert factor == pytest.approx(ramp * first_inner[epoch])
        assert factor > 0 or first_inner[epoch] == 0
    if 0 < steps <= len(losses):
        assert factors[steps - 1] == first_inner[steps - 1]
    inner_factors, inner_states = run(inner, losses[steps:])
    assert factors[steps:] == inner_factors
    assert [s.inner for s in states[steps:]] == inner_states[: len(states[steps:])]


@moderate
@given(start=st.floats(min_value=0, max_value=1), steps=st.integers(min_value=1, max_value=30))
def test_warmup_rises_towards_a_flat_schedule(start: float, steps: int) -> None:
    schedule = schedules.warmup(steps, schedules.noop(), start=start)
    factors, _ = run(schedule, [None] * (steps + 2))
    assert factors[0] > 0
    assert all(a <= b for a, b in itertools.pairwise(factors))
    assert factors[steps - 1 :] == [1.0, 1.0, 1.0]


# --- validation -----------------------------------------------------------------------------


BAD_FACTORIES: list[Callable[[], object]] = [
    lambda: schedules.from_epoch_count(1.0),  # type: ignore[arg-type]
    lambda: schedules.decrement(0, 0.5),
    lambda: schedules.decrement(2, 0.0),
    lambda: schedules.decrement(2, 1.5),
    lambda: schedules.decrement(2.0, 0.5),  # type: ignore[arg-type]
    lambda: schedules.step_after(-1, 0.5),
    lambda: schedules.step_after(3, math.nan),
    lambda: schedules.linear(-0.1, 1.0, 10),
    lambda: schedules.linear(0.1, math.inf, 10),
    lambda: schedules.linear(0.1, 1.0, 0),
    lambda: schedules.cyclic(0.0, 10),
    lambda: schedules.cyclic(2.0, 1),
    lambda: schedules.cosine(0),
    lambda: schedules.cosine(10, min_factor=1.5),
    lambda: schedules.warmup(-1, schedules.noop()),
    lambda: schedules.warmup(3, schedules.noop(), start=1.5),
    lambda: schedules.warmup(3, "noop"),  # type: ignore[arg-type]
    lambda: schedules.reduce_on_plateau(start_factor=0),
    lambda: schedules.reduce_on_plateau(reduce_factor=1.0),
    lambda: schedules.reduce_on_plateau(reduce_factor=0.0),
    lambda: schedules.reduce_on_plateau(patience=0),
    lambda: schedules.reduce_on_plateau(patience=True),
    lambda: schedules.reduce_on_plateau(threshold=-1e-4),
    lambda: schedules.reduce_on_plateau(stop_factor=math.inf),
]


@pytest.mark.parametrize("factory", BAD_FACTORIES)
def test_factories_reject_bad_arguments_with_config_error(factory: Callable[[], object]) -> None:
    with pytest.raises(lampdist.ConfigError) as caught:
        factory()
    assert isinstance(caught.value, ValueError)
    assert "\n" not in str(caught.value)


# --- JSON states ----------------------------------------------------------------------------


def _leaf_schedules() -> st.SearchStrategy[LearningRateSchedule[Any]]:
    unit = st.floats(min_value=0.01, max_value=1)
    return st.one_of(
        st.just(schedules.noop()),
        st.builds(schedules.decrement, st.integers(1, 5), unit),
        st.builds(schedules.step_after, st.integers(0, 5), unit),
        st.builds(schedules.linear, unit, unit, st.integers(1, 10)),
        st.builds(schedules.cyclic, unit, st.integers(2, 10)),
        st.builds(schedules.cosine, st.integers(1, 10), unit),
        st.builds(
            lambda p, r, a: schedules.reduce_on_plateau(
                patience=p, reduce_factor=r, relative_threshold_mode=a
            ),
            st.integers(1, 4),
            st.floats(min_value=0.1, max_value=0.9),
            st.booleans(),
        ),
    )


SCHEDULES = st.recursive(
    _leaf_schedules(),
    lambda inner: st.builds(schedules.warmup, st.integers(0, 4), inner, st.floats(0, 1)),
    max_leaves=3,
)


@moderate
@given(schedule=SCHEDULES, losses=st.lists(st.none() | LOSS | st.just(-math.inf), max_size=30))
def test_every_state_round_trips_through_strict_json(
    schedule: LearningRateSchedule[Any], losses: list[float | None]
) -> None:
    _, states = run(schedule, losses)
    for state in states:
        text = json.dumps(schedules.state_to_json(state), allow_nan=False)
        assert schedules.state_from_json(schedule, json.loads(text)) == state


@moderate
@given(schedule=SCHEDULES, losses=LOSSES, split=st.integers(min_value=0, max_value=40))
def test_resuming_from_a_json_state_continues_exactly(
    schedule: LearningRateSchedule[Any], losses: list[float | None], split: int
) -> None:
    split = min(split, len(losses))
    factors, states = run(schedule, losses)
    stored = json.loads(json.dumps(schedules.state_to_json(states[split])))
    resumed, _ = run(
        schedule,
        losses[split:],
        first_epoch=split,
        state=schedules.state_from_json(schedule, stored),
    )
    assert factors[:split] + resumed == factors


@attrs.frozen(kw_only=True)
class _Counter:
    count: int
    total: float | None = None


@attrs.frozen(kw_only=True)
class _CountingSchedule:
    """A user-defined schedule with its own state class."""

    @property
    def init(self) -> _Counter:
        return _Counter(count=0)

    def learning_rate_factor(
        self, state: _Counter, epoch: int, last_validation_loss: float | None
    ) -> tuple[_Counter, float]:
        total = None if last_validation_loss is None else (state.total or 0) + last_validation_loss
        return _Counter(count=state.count + 1, total=total), 1.0


def test_a_user_defined_state_round_trips_from_its_annotations() -> None:
    schedule: LearningRateSchedule[_Counter] = _CountingSchedule()
    state = _Counter(count=3, total=-math.inf)
    data = schedules.state_to_json(state)
    assert data == {"count": 3, "total": "-Infinity"}
    assert schedules.state_from_json(schedule, json.loads(json.dumps(data))) == state
    wrapped = schedules.warmup(2, schedule)
    wrapped_state = schedules.WarmupState(inner=state)
    data = schedules.state_to_json(wrapped_state)
    assert schedules.state_from_json(wrapped, data) == wrapped_state


@pytest.mark.parametrize(
    ("schedule", "data"),
    [
        (schedules.noop(), {"factor": 1.0}),
        (schedules.reduce_on_plateau(), None),
        (schedules.reduce_on_plateau(), {"factor": 1.0}),
        (
            schedules.reduce_on_plateau(),
            {"factor": "1", "best_loss": None, "last_improvement_epoch": -1},
        ),
        (
            schedules.reduce_on_plateau(),
            {"factor": 1.0, "best_loss": None, "last_improvement_epoch": 1.5},
        ),
        (schedules.warmup(2, schedules.noop()), None),
        (schedules.warmup(2, schedules.noop()), {"inner": 3}),
    ],
)
def test_state_from_json_rejects_data_of_another_schedule(
    schedule: LearningRateSchedule[Any], data: object
) -> None:
    with pytest.raises(lampdist.ConfigError, match="not a state of"):
        schedules.state_from_json(schedule, data)


def test_state_to_json_rejects_what_json_cannot_hold() -> None:
    with pytest.raises(lampdist.ConfigError, match="must be made of"):
        schedules.state_to_json(object())
    with pytest.raises(lampdist.ConfigError, match="must be made of"):
        schedules.state_to_json({"weights": torch.zeros(2)})
    with pytest.raises(lampdist.ConfigError, match="must be made of"):
        schedules.state_to_json({1: 2.0})  # JSON keys are strings


@attrs.frozen
class _JsonSchedule:
    """A user schedule whose state is plain JSON."""

    init: dict[str, Any] = attrs.field(factory=lambda: {"factor": 1.0, "seen": [], "tag": "a"})

    def learning_rate_factor(
        self, state: dict[str, Any], epoch: int, last_validation_loss: float | None
    ) -> tuple[dict[str, Any], float]:
        return {**state, "seen": [*state["seen"], epoch]}, state["factor"]


@dataclasses.dataclass(frozen=True)
class _DataclassState:
    count: int
    history: tuple[float, ...] = ()
    best: float | None = None


@attrs.frozen
class _DataclassSchedule:
    init: _DataclassState = _DataclassState(count=0)

    def learning_rate_factor(
        self, state: _DataclassState, epoch: int, last_validation_loss: float | None
    ) -> tuple[_DataclassState, float]:
        loss = last_validation_loss
        history = state.history if loss is None else (*state.history, loss)
        return _DataclassState(count=state.count + 1, history=history, best=loss), 1.0


@pytest.mark.parametrize(
    ("schedule", "state"),
    [
        (_JsonSchedule(), {"factor": 0.5, "seen": [0, 1], "tag": "b", "flag": True}),
        (_DataclassSchedule(), _DataclassState(count=2, history=(0.5, 0.25), best=0.25)),
        (
            schedules.warmup(2, _DataclassSchedule()),
            schedules.WarmupState(inner=_DataclassState(count=1, history=(1.5,))),
        ),
        (
            schedules.warmup(2, schedules.reduce_on_plateau()),
            schedules.WarmupState(inner=schedules.ReduceOnPlateauState(factor=0.5, best_loss=0.3)),
        ),
    ],
    ids=["plain-json", "dataclass", "warmup-of-dataclass", "warmup-of-plateau"],
)
def test_plain_json_dataclass_and_composed_states_round_trip(
    schedule: LearningRateSchedule[Any], state: Any
) -> None:
    data = json.loads(json.dumps(schedules.state_to_json(state), allow_nan=False))
    back = schedules.state_from_json(schedule, data)
    assert back == state
    assert type(back) is type(state)
