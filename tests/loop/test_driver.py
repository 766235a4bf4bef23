"""The pure epoch driver, driven by recording async effects (runs on asyncio and trio)."""

from __future__ import annotations

import logging
import math
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lampdist
from lampdist import CurvePoint, LoopState, epochs, schedules
from lampdist.schedules import LearningRateSchedule

moderate = settings(max_examples=100, deadline=None)

MAX_EPOCHS = 12
Call = tuple[object, ...]


@attrs.define(eq=False)
class Effects:
    """Effects that record each call and return the losses a scenario drew for that epoch."""

    train_losses: tuple[float, ...]
    valid_losses: tuple[float, ...]
    next_epoch: int = 0
    current: int = -1
    calls: list[Call] = attrs.field(factory=list)

    async def train(self, factor: float) -> float:
        self.current = self.next_epoch
        self.next_epoch += 1
        self.calls.append(("train", self.current, factor))
        return self.train_losses[self.current]

    async def validate(self) -> float:
        self.calls.append(("validate", self.current))
        return self.valid_losses[self.current]

    async def save(self) -> None:
        self.calls.append(("save", self.current))

    async def checkpoint(self, state: LoopState, lr_state: Any) -> None:
        self.calls.append(("checkpoint", state, lr_state))


@attrs.define(eq=False)
class RecordingSchedule:
    """Wraps a schedule and records what the driver asked it and what it answered."""

    inner: LearningRateSchedule[Any]
    seen: list[tuple[int, float | None, float]] = attrs.field(factory=list)

    @property
    def init(self) -> Any:
        return self.inner.init

    def learning_rate_factor(
        self, state: Any, epoch: int, last_validation_loss: float | None
    ) -> tuple[Any, float]:
        new_state, factor = self.inner.learning_rate_factor(state, epoch, last_validation_loss)
        self.seen.append((epoch, last_validation_loss, factor))
        return new_state, factor


@attrs.frozen(kw_only=True)
class Scenario:
    max_epochs: int
    validate: bool
    validation_frequency: int
    smoothing: float
    save_epochs: frozenset[int]
    train_losses: tuple[float, ...]
    valid_losses: tuple[float, ...]

    def effects(self, first_epoch: int = 0) -> Effects:
        return Effects(self.train_losses, self.valid_losses, next_epoch=first_epoch)

    async def run(
        self,
        effects: Effects,
        schedule: LearningRateSchedule[Any],
        *,
        max_epochs: int | None = None,
        init_state: LoopState | None = None,
        lr_state: Any = None,
    ) -> LoopState:
        return await epochs(
            max_epochs=self.max_epochs if max_epochs is None else max_epochs,
            train_epoch=effects.train,
            validation_epoch=effects.validate if self.validate else None,
            save_min_validation_loss_model=effects.save,
            checkpoint_state=effects.checkpoint,
            validation_frequency=self.validation_frequency,
            return_min_validation_loss_model=self.save_epochs,
            learning_rate_schedule=schedule,
            init_state=init_state,
            learning_rate_schedule_init_state=lr_state,
            validation_loss_exponential_smoothing_factor=self.smoothing,
        )


LOSS = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False)


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    return Scenario(
        max_epochs=draw(st.integers(min_value=0, max_value=MAX_EPOCHS)),
        validate=draw(st.booleans()),
        validation_frequency=draw(st.integers(min_value=1, max_value=4)),
        smoothing=draw(st.just(1.0) | st.floats(min_value=0.01, max_value=1.0)),
        save_epochs=draw(st.frozensets(st.integers(min_value=0, max_value=MAX_EPOCHS))),
        train_losses=tuple(draw(st.lists(LOSS, min_size=MAX_EPOCHS, max_size=MAX_EPOCHS))),
        valid_losses=tuple(draw(st.lists(LOSS, min_size=MAX_EPOCHS, max_size=MAX_EPOCHS))),
    )


STATELESS = [
    schedules.noop(),
    schedules.decrement(3, 0.5),
    schedules.cyclic(3.0, 4),
    schedules.linear(0.1, 2.0, 5),
]


@moderate
@given(scenario=scenarios(), inner=st.sampled_from(STATELESS))
async def test_each_epoch_follows_the_rules(
    scenario: Scenario, inner: LearningRateSchedule[None]
) -> None:
    effects = scenario.effects()
    schedule = RecordingSchedule(inner)
    final = await scenario.run(effects, schedule)

    # The rules, written out epoch by epoch.
    a = scenario.smoothing
    state = LoopState()
    calls: list[Call] = []
    seen: list[tuple[int, float | None, float]] = []
    for epoch in range(scenario.max_epochs):
        factor = inner.learning_rate_factor(None, epoch, state.last_validation_loss)[1]
        seen.append((epoch, state.last_validation_loss, factor))
        calls.append(("train", epoch, factor))
        raw = smoothed = None
        last = state.last_validation_loss
        best, best_epoch = state.min_validation_loss, state.min_validation_epoch
        if scenario.validate and epoch % scenario.validation_frequency == 0:
            calls.append(("validate", epoch))
            raw = scenario.valid_losses[epoch]
            smoothed = raw if last is None else a * raw + (1 - a) * last
            last = smoothed
            if epoch in scenario.save_epochs and (best is None or smoothed < best):
                calls.append(("save", epoch))
                best, best_epoch = smoothed, epoch
        point = CurvePoint(
            epoch=epoch,
            training_loss=scenario.train_losses[epoch],
            validation_loss=raw,
            smoothed_validation_loss=smoothed,
        )
        state = LoopState(
            epoch=epoch + 1,
            last_validation_loss=last,
            min_validation_loss=best,
            min_validation_epoch=best_epoch,
            learning_curve=(*state.learning_curve, point),
        )
        calls.append(("checkpoint", state, None))
    end = scenario.max_epochs
    seen.append((end, state.last_validation_loss, inner.learning_rate_factor(None, end, None)[1]))

    assert effects.calls == calls
    assert final == state
    assert final.epoch == scenario.max_epochs
    # The schedule is asked once more, at max_epochs, before the loop stops.
    assert schedule.seen == seen


@moderate
@given(
    scenario=scenarios(),
    stop_epoch=st.integers(min_value=0, max_value=MAX_EPOCHS),
    stop_factor=st.floats(min_value=-1.0, max_value=0.0),
)
async def test_a_factor_of_zero_or_less_stops_before_the_epoch(
    scenario: Scenario, stop_epoch: int, stop_factor: float
) -> None:
    effects = scenario.effects()
    schedule = schedules.from_epoch_count(lambda e: stop_factor if e >= stop_epoch else 1.0)
    final = await scenario.run(effects, schedule)
    ran = min(stop_epoch, scenario.max_epochs)
    assert final.epoch == ran
    assert [c[1] for c in effects.calls if c[0] == "train"] == list(range(ran))
    checkpoints = [c[1] for c in effects.calls if c[0] == "checkpoint"]
    assert [s.epoch for s in checkpoints if isinstance(s, LoopState)] == list(range(1, ran + 1))
    assert [p.epoch for p in final.learning_curve] == list(range(ran))


RESUMABLE: list[LearningRateSchedule[Any]] = [
    schedules.noop(),
    schedules.decrement(2, 0.5),
    schedules.reduce_on_plateau(patience=2, reduce_factor=0.5, stop_factor=0.2),
]


@moderate
@given(
    scenario=scenarios(),
    schedule=st.sampled_from(RESUMABLE),
    split=st.integers(min_value=0, max_value=MAX_EPOCHS),
)
async def test_resuming_from_a_checkpoint_equals_one_uninterrupted_run(
    scenario: Scenario, schedule: LearningRateSchedule[Any], split: int
) -> None:
    whole = scenario.effects()
    uninterrupted = await scenario.run(whole, schedule)

    first = scenario.effects()
    await scenario.run(first, schedule, max_epochs=min(split, scenario.max_epochs))
    checkpoints = [c for c in first.calls if c[0] == "checkpoint"]
    init_state, lr_state = (None, None)
    if checkpoints:
        _, init_state, lr_state = checkpoints[-1]
    assert init_state is None or isinstance(init_state, LoopState)
    second = scenario.effects(first_epoch=init_state.epoch if init_state else 0)
    resumed = await scenario.run(second, schedule, init_state=init_state, lr_state=lr_state)

    assert resumed == uninterrupted
    assert first.calls + second.calls == whole.calls


async def test_schedule_state_is_threaded_and_can_be_given_to_resume() -> None:
    schedule = schedules.reduce_on_plateau(patience=1, stop_factor=0.1)
    effects = Effects((1.0,) * 6, (5.0,) * 6)
    final = await epochs(
        max_epochs=6,
        train_epoch=effects.train,
        validation_epoch=effects.validate,
        checkpoint_state=effects.checkpoint,
        learning_rate_schedule=schedule,
        learning_rate_schedule_init_state=schedules.ReduceOnPlateauState(factor=0.8),
    )
    # A flat validation loss halves the factor every epoch after the first; 0.1 stops.
    assert [c[2] for c in effects.calls if c[0] == "train"] == [0.8, 0.8, 0.4, 0.2]
    assert final.epoch == 4
    assert effects.calls[-1][2] == schedules.ReduceOnPlateauState(
        factor=0.2, best_loss=5.0, last_improvement_epoch=3
    )


@pytest.mark.parametrize("smoothing", [1.0, 0.5])
async def test_non_finite_losses_pass_through(smoothing: float) -> None:
    train = (math.nan, math.inf, -math.inf, 1.0)
    valid = (math.inf, 2.0, math.nan, 1.0)
    effects = Effects(train, valid)
    final = await epochs(
        max_epochs=4,
        train_epoch=effects.train,
        validation_epoch=effects.validate,
        save_min_validation_loss_model=effects.save,
        return_min_validation_loss_model=range(4),
        validation_loss_exponential_smoothing_factor=smoothing,
    )
    curve = final.learning_curve
    assert [p.training_loss for p in curve][1:] == [math.inf, -math.inf, 1.0]
    assert math.isnan(curve[0].training_loss)
    assert curve[0].validation_loss == math.inf
    assert math.isnan(curve[2].validation_loss or 0.0)
    smoothed = [p.smoothed_validation_loss for p in curve]
    if smoothing == 1.0:
        # Without smoothing each epoch stands alone: a NaN does not poison the next epoch.
        assert smoothed[:2] == [math.inf, 2.0]
        assert smoothed[3] == 1.0
        assert [c for c in effects.calls if c[0] == "save"] == [("save", 1), ("save", 3)]
        assert (final.min_validation_loss, final.min_validation_epoch) == (1.0, 3)
    else:
        assert smoothed[:2] == [math.inf, math.inf]
        assert all(math.isnan(s or 0.0) for s in smoothed[2:])
        assert [c for c in effects.calls if c[0] == "save"] == []
        assert final.min_validation_loss is None


async def test_the_best_epochs_may_be_given_as_a_one_shot_iterable() -> None:
    effects = Effects((1.0,) * 5, (5.0, 4.0, 3.0, 2.0, 1.0))
    final = await epochs(
        max_epochs=5,
        train_epoch=effects.train,
        validation_epoch=effects.validate,
        save_min_validation_loss_model=effects.save,
        return_min_validation_loss_model=(e for e in (1, 3)),
    )
    assert [c for c in effects.calls if c[0] == "save"] == [("save", 1), ("save", 3)]
    assert (final.min_validation_loss, final.min_validation_epoch) == (2.0, 3)


@pytest.mark.parametrize(
    "arguments",
    [
        {"max_epochs": -1},
        {"max_epochs": 2.0},
        {"max_epochs": True},
        {"validation_frequency": 0},
        {"validation_frequency": 1.5},
        {"validation_loss_exponential_smoothing_factor": 0.0},
        {"validation_loss_exponential_smoothing_factor": 1.5},
        {"validation_loss_exponential_smoothing_factor": math.nan},
        {"init_state": LoopState(epoch=-1)},
    ],
)
async def test_invalid_arguments_raise_config_error_before_any_effect(
    arguments: dict[str, Any],
) -> None:
    effects = Effects((1.0,) * 3, (1.0,) * 3)
    options: dict[str, Any] = {"max_epochs": 3, **arguments}
    with pytest.raises(lampdist.ConfigError) as caught:
        await epochs(train_epoch=effects.train, validation_epoch=effects.validate, **options)
    assert isinstance(caught.value, ValueError)
    assert "\n" not in str(caught.value)
    assert effects.calls == []


async def test_a_nan_factor_from_the_schedule_raises_config_error() -> None:
    effects = Effects((1.0,) * 5, ())
    schedule = schedules.from_epoch_count(lambda e: math.nan if e == 2 else 1.0)
    with pytest.raises(lampdist.ConfigError, match="epoch 2"):
        await epochs(max_epochs=5, train_epoch=effects.train, learning_rate_schedule=schedule)
    assert [c[1] for c in effects.calls] == [0, 1]


async def test_an_effect_error_propagates_and_nothing_after_it_runs() -> None:
    effects = Effects((1.0,) * 5, (1.0,) * 5)

    async def validate() -> float:
        if effects.current == 2:
            raise RuntimeError("validation pass failed")
        return await effects.validate()

    with pytest.raises(RuntimeError, match="validation pass failed"):
        await epochs(
            max_epochs=5,
            train_epoch=effects.train,
            validation_epoch=validate,
            checkpoint_state=effects.checkpoint,
        )
    assert [c[0] for c in effects.calls][-2:] == ["checkpoint", "train"]
    assert [c[1].epoch for c in effects.calls if isinstance(c[1], LoopState)] == [1, 2]


async def test_one_info_line_per_epoch_carries_the_epoch(caplog: pytest.LogCaptureFixture) -> None:
    effects = Effects((0.5,) * 4, (0.25,) * 4)
    with caplog.at_level(logging.INFO, logger="lampdist._loop"):
        await epochs(
            max_epochs=4,
            train_epoch=effects.train,
            validation_epoch=effects.validate,
            validation_frequency=2,
        )
    records = [r for r in caplog.records if r.levelno == logging.INFO]
    assert [getattr(r, "epoch", None) for r in records] == [0, 1, 2, 3]
    assert "0.25" in records[0].getMessage()
    assert "0.5" in records[1].getMessage()
