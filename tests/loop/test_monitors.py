"""Choosing and stopping by any reported value, in the pure epoch driver: the best model,
reduce_on_plateau and early stopping, against hand-computed sequences (asyncio and trio)."""

from __future__ import annotations

import logging
from typing import Any

import attrs
import pytest

import lampdist
from lampdist import EarlyStopping, EarlyStoppingState, LoopState, Monitor, epochs, schedules

ACCURACY = Monitor("validation_accuracy", mode="max")


@attrs.define(eq=False)
class Effects:
    """Pass effects that report a loss and an accuracy per epoch, and record every call."""

    valid_losses: tuple[float, ...]
    accuracies: tuple[float, ...]
    train_accuracies: tuple[float, ...] = ()
    next_epoch: int = 0
    current: int = -1
    calls: list[tuple[Any, ...]] = attrs.field(factory=list)

    async def train(self, factor: float) -> tuple[float, dict[str, float]]:
        self.current = self.next_epoch
        self.next_epoch += 1
        self.calls.append(("train", self.current, factor))
        metrics = {}
        if self.train_accuracies:
            metrics["accuracy"] = self.train_accuracies[self.current]
        return 1.0, metrics

    async def validate(self) -> tuple[float, dict[str, float]]:
        self.calls.append(("validate", self.current))
        return self.valid_losses[self.current], {"accuracy": self.accuracies[self.current]}

    async def save(self) -> None:
        self.calls.append(("save", self.current))

    async def checkpoint(self, state: LoopState, lr_state: Any) -> None:
        self.calls.append(("checkpoint", state, lr_state))


# The accuracy and the loss disagree: the loss is lowest at epoch 2, the accuracy highest at 3.
LOSSES = (0.9, 0.5, 0.3, 0.4, 0.35, 0.6)
ACCURACIES = (0.5, 0.7, 0.6, 0.8, 0.8, 0.75)


async def test_the_best_model_by_the_highest_accuracy() -> None:
    effects = Effects(LOSSES, ACCURACIES)
    state = await epochs(
        max_epochs=6,
        train_epoch=effects.train,
        validation_epoch=effects.validate,
        save_min_validation_loss_model=effects.save,
        return_min_validation_loss_model=range(6),
        best_model_monitor=ACCURACY,
    )
    # 0.5, then 0.7 and 0.8 are better; a second 0.8 is not strictly better
    assert [c[1] for c in effects.calls if c[0] == "save"] == [0, 1, 3]
    assert (state.min_validation_epoch, state.min_validation_loss) == (3, 0.8)
    assert [p.metrics for p in state.learning_curve] == [
        {"validation_accuracy": a} for a in ACCURACIES
    ]
    # lamp's default on the same run: the lowest smoothed validation loss
    effects = Effects(LOSSES, ACCURACIES)
    state = await epochs(
        max_epochs=6,
        train_epoch=effects.train,
        validation_epoch=effects.validate,
        save_min_validation_loss_model=effects.save,
        return_min_validation_loss_model=range(6),
    )
    assert [c[1] for c in effects.calls if c[0] == "save"] == [0, 1, 2]
    assert (state.min_validation_epoch, state.min_validation_loss) == (2, 0.3)


async def test_the_best_model_among_the_given_epochs_only() -> None:
    effects = Effects(LOSSES, ACCURACIES)
    state = await epochs(
        max_epochs=6,
        train_epoch=effects.train,
        validation_epoch=effects.validate,
        save_min_validation_loss_model=effects.save,
        return_min_validation_loss_model={0, 2, 4, 5},
        best_model_monitor=ACCURACY,
    )
    assert [c[1] for c in effects.calls if c[0] == "save"] == [0, 2, 4]  # 0.5, 0.6, 0.8
    assert (state.min_validation_epoch, state.min_validation_loss) == (4, 0.8)


async def test_reduce_on_plateau_by_the_highest_accuracy() -> None:
    """The schedule gets the newest accuracy before each epoch (None before the first)."""
    accuracies = (0.5, 0.55, 0.7, 0.65, 0.9, 0.9)
    schedule = schedules.reduce_on_plateau(
        patience=1, threshold=0.1, relative_threshold_mode=False, monitor=ACCURACY
    )
    effects = Effects((1.0,) * 6, accuracies)
    state = await epochs(
        max_epochs=6,
        train_epoch=effects.train,
        validation_epoch=effects.validate,
        learning_rate_schedule=schedule,
        checkpoint_state=effects.checkpoint,
    )
    # epoch 0: no value yet, 1; epoch 1: 0.5 is the first, 1; epoch 2: 0.55 is not 0.1 above
    # 0.5, one epoch since: 0.5; epoch 3: 0.7 improves, 0.5; epoch 4: 0.65 does not: 0.25;
    # epoch 5: 0.9 improves, 0.25.
    assert [c[2] for c in effects.calls if c[0] == "train"] == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]
    assert state.epoch == 6
    last_lr_state = effects.calls[-1][2]
    assert last_lr_state == schedules.ReduceOnPlateauState(
        factor=0.25, best_loss=0.9, last_improvement_epoch=5
    )


async def test_reduce_on_plateau_relative_threshold_by_a_maximum() -> None:
    monitor = Monitor("validation_accuracy", mode="max")
    schedule = schedules.reduce_on_plateau(patience=1, threshold=0.1, monitor=monitor)
    state = schedule.init
    # 0.5 then 0.54 (not above 0.5 * 1.1), 0.56 (above 0.55)
    state, factor = schedule.learning_rate_factor(state, 1, 0.5)
    assert (state.best_loss, factor) == (0.5, 1.0)
    state, factor = schedule.learning_rate_factor(state, 2, 0.54)
    assert (state.best_loss, factor) == (0.5, 0.5)
    state, factor = schedule.learning_rate_factor(state, 3, 0.56)
    assert (state.best_loss, factor) == (0.56, 0.5)
    # a negative best: -2.0 then -1.85 is above -2.0 * 0.9 = -1.8? no; -1.7 is
    state = schedule.init
    state, _ = schedule.learning_rate_factor(state, 1, -2.0)
    state, factor = schedule.learning_rate_factor(state, 2, -1.85)
    assert (state.best_loss, factor) == (-2.0, 0.5)
    state, _ = schedule.learning_rate_factor(state, 3, -1.7)
    assert state.best_loss == -1.7


async def test_a_wrapped_schedule_watches_its_inner_monitor() -> None:
    inner = schedules.reduce_on_plateau(patience=1, monitor=ACCURACY)
    # the accuracy never improves after the first; the loss rises, which the inner schedule
    # (mode max) would take for improvements if it were given the loss
    effects = Effects((1.0, 1.1, 1.2, 1.3), (0.5, 0.5, 0.5, 0.5))
    await epochs(
        max_epochs=4,
        train_epoch=effects.train,
        validation_epoch=effects.validate,
        learning_rate_schedule=schedules.warmup(1, inner, start=1.0),
    )
    # warm-up epoch 0, then the inner schedule's epoch 0 sees 0.5 (the first), epochs 1 and
    # 2 see 0.5 again: no improvement, halved each time
    assert [c[2] for c in effects.calls if c[0] == "train"] == [1.0, 1.0, 0.5, 0.25]


def _lightning(values: list[float | None], patience: int, min_delta: float, mode: str) -> int:
    """Where Lightning's EarlyStopping rule stops: the number of epochs run."""
    best, wait = None, 0
    for epoch, value in enumerate(values):
        if value is None:
            continue
        better = (
            best is None
            or (mode == "max" and value - min_delta > best)
            or (mode == "min" and value + min_delta < best)
        )
        best, wait = (value, 0) if better else (best, wait + 1)
        if wait >= patience:
            return epoch + 1
    return len(values)


async def test_early_stopping_by_the_highest_accuracy() -> None:
    accuracies = (0.5, 0.7, 0.72, 0.74, 0.9, 0.95, 0.96, 0.97)
    effects = Effects((1.0,) * 8, accuracies)
    rule = EarlyStopping(monitor=ACCURACY, patience=2, min_delta=0.05)
    state = await epochs(
        max_epochs=8,
        train_epoch=effects.train,
        validation_epoch=effects.validate,
        checkpoint_state=effects.checkpoint,
        early_stopping=rule,
    )
    # 0.5, then 0.7 (> 0.55); 0.72 and 0.74 are not 0.05 above 0.7: two epochs, stop
    assert state.epoch == 4 == _lightning(list(accuracies), 2, 0.05, "max")
    assert state.early_stopping == EarlyStoppingState(best=0.7, wait=2)
    assert [c[1] for c in effects.calls if c[0] == "train"] == [0, 1, 2, 3]
    checkpoints = [c[1] for c in effects.calls if c[0] == "checkpoint"]
    assert [s.early_stopping for s in checkpoints] == [
        EarlyStoppingState(best=0.5, wait=0),
        EarlyStoppingState(best=0.7, wait=0),
        EarlyStoppingState(best=0.7, wait=1),
        EarlyStoppingState(best=0.7, wait=2),
    ]
    assert checkpoints[-1] == state  # the last epoch is checkpointed, then the loop ends


async def test_early_stopping_counts_the_validated_epochs_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    losses = (1.0, 9.0, 0.9, 9.0, 0.95, 9.0, 0.97, 9.0, 0.5, 9.0)
    effects = Effects(losses, (0.0,) * 10)
    rule = EarlyStopping(monitor=Monitor("validation_loss"), patience=2)
    with caplog.at_level(logging.INFO, logger="lampdist._loop._driver"):
        state = await epochs(
            max_epochs=10,
            train_epoch=effects.train,
            validation_epoch=effects.validate,
            validation_frequency=2,
            early_stopping=rule,
        )
    # validated: epoch 0 (1.0), 2 (0.9), 4 (0.95), 6 (0.97): two without improvement
    validated = [v if e % 2 == 0 else None for e, v in enumerate(losses)]
    assert state.epoch == 7 == _lightning(validated, 2, 0.0, "min")
    assert state.early_stopping == EarlyStoppingState(best=0.9, wait=2)
    assert any("early stopping before epoch 7" in r.getMessage() for r in caplog.records)


async def test_early_stopping_by_a_training_metric_counts_every_epoch() -> None:
    effects = Effects((1.0,) * 6, (0.0,) * 6, train_accuracies=(0.1, 0.2, 0.2, 0.1, 0.9, 0.9))
    state = await epochs(
        max_epochs=6,
        train_epoch=effects.train,
        early_stopping=EarlyStopping(monitor=Monitor("training_accuracy", "max"), patience=2),
    )
    assert state.epoch == 4
    assert [p.metrics for p in state.learning_curve][:2] == [
        {"training_accuracy": 0.1},
        {"training_accuracy": 0.2},
    ]


async def test_a_nan_never_improves() -> None:
    nan = float("nan")
    effects = Effects((1.0,) * 5, (0.5, nan, nan, 0.9, 1.0))
    state = await epochs(
        max_epochs=5,
        train_epoch=effects.train,
        validation_epoch=effects.validate,
        save_min_validation_loss_model=effects.save,
        return_min_validation_loss_model=range(5),
        best_model_monitor=ACCURACY,
        early_stopping=EarlyStopping(monitor=ACCURACY, patience=2),
    )
    assert [c[1] for c in effects.calls if c[0] == "save"] == [0]
    assert state.epoch == 3


async def test_an_early_stopped_run_resumes_exactly() -> None:
    """From every checkpoint of a run that stopped early, the resumed run makes the same
    calls after it and ends in the same state; from the last, it runs no epoch."""
    accuracies = (0.5, 0.7, 0.6, 0.8, 0.75, 0.7, 0.9, 0.95)
    rule = EarlyStopping(monitor=ACCURACY, patience=2)
    schedule = schedules.reduce_on_plateau(patience=1, monitor=ACCURACY)

    async def run(start: LoopState | None, lr_state: Any, first: int) -> tuple[LoopState, Effects]:
        effects = Effects((1.0,) * 8, accuracies, next_epoch=first)
        state = await epochs(
            max_epochs=8,
            train_epoch=effects.train,
            validation_epoch=effects.validate,
            save_min_validation_loss_model=effects.save,
            return_min_validation_loss_model=range(8),
            best_model_monitor=ACCURACY,
            checkpoint_state=effects.checkpoint,
            learning_rate_schedule=schedule,
            early_stopping=rule,
            init_state=start,
            learning_rate_schedule_init_state=lr_state,
        )
        return state, effects

    whole, effects = await run(None, None, 0)
    assert whole.epoch == 6  # 0.8 at epoch 3, then 0.75 and 0.7
    checkpoints = [c for c in effects.calls if c[0] == "checkpoint"]
    for index, (_, saved, lr_state) in enumerate(checkpoints):
        resumed, again = await run(saved, lr_state, saved.epoch)
        assert resumed == whole
        position = effects.calls.index(checkpoints[index])
        assert again.calls == effects.calls[position + 1 :]
    assert (await run(whole, checkpoints[-1][2], 6))[1].calls == []


async def test_a_monitor_of_an_unreported_or_vector_value_is_refused() -> None:
    effects = Effects(LOSSES, ACCURACIES)
    with pytest.raises(lampdist.ConfigError, match="watches 'validation_acc', which epoch 0"):
        await epochs(
            max_epochs=3,
            train_epoch=effects.train,
            validation_epoch=effects.validate,
            early_stopping=EarlyStopping(monitor=Monitor("validation_acc", "max")),
        )

    async def vector() -> tuple[float, dict[str, tuple[float, ...]]]:
        return 1.0, {"recall": (0.5, 0.7)}

    with pytest.raises(lampdist.ConfigError, match="'validation_recall', which has 2 values"):
        await epochs(
            max_epochs=3,
            train_epoch=effects.train,
            validation_epoch=vector,
            return_min_validation_loss_model=range(3),
            best_model_monitor=Monitor("validation_recall", "max"),
        )
    with pytest.raises(lampdist.ConfigError, match="does not validate"):
        await epochs(max_epochs=3, train_epoch=effects.train, early_stopping=EarlyStopping())


def test_monitors_and_rules_check_their_arguments() -> None:
    for bad in ("accuracy", "validation_", "", 3):
        with pytest.raises(lampdist.ConfigError, match="a Monitor watches"):
            Monitor(bad)  # type: ignore[arg-type]
    with pytest.raises(lampdist.ConfigError, match="mode must be 'min'"):
        Monitor("training_loss", "maximum")  # type: ignore[arg-type]
    for patience in (0, 1.5, True):
        with pytest.raises(lampdist.ConfigError, match="patience must be an int >= 1"):
            EarlyStopping(patience=patience)  # type: ignore[arg-type]
    with pytest.raises(lampdist.ConfigError, match="min_delta"):
        EarlyStopping(min_delta=-0.1)
    with pytest.raises(lampdist.ConfigError, match=r"monitor must be a lampdist\.Monitor"):
        schedules.reduce_on_plateau(monitor="validation_accuracy")  # type: ignore[arg-type]
    with pytest.raises(lampdist.ConfigError, match="best_model_monitor must be"):
        lampdist.LoopOptions(max_epochs=1, best_model_monitor="x")  # type: ignore[arg-type]
    assert Monitor() == Monitor("smoothed_validation_loss", "min")
    assert not Monitor("training_accuracy").validation and Monitor("validation_loss").validation
