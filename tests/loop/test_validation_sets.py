"""The epoch driver's validation before training, several sets merged into one outcome, and
how the sets' values reach the records (commands, trackers)."""

from __future__ import annotations

import math

import pytest

import lampdist
from lampdist import LoopState, Monitor, epochs, schedules
from lampdist._loop import merge_sets
from lampdist.control import Command, CommandKind
from lampdist.trackers._base import event_scalars
from lampdist.trackers._files import EVENT_FIELDS, event_record


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Recorder:
    """Effects that record their calls: training losses fall, validation losses as given."""

    def __init__(self, valid: list[float]) -> None:
        self.valid = list(valid)
        self.calls: list[tuple[str, object]] = []

    async def train(self, factor: float) -> float:
        self.calls.append(("train", factor))
        return 1.0

    async def validate(self) -> tuple[float, dict[str, float]]:
        loss = self.valid.pop(0)
        self.calls.append(("valid", loss))
        return loss, {"b_loss": 2 * loss}


async def test_the_validation_before_training_is_the_point_of_epoch_minus_one() -> None:
    effects = Recorder([5.0, 3.0, 4.0])
    state = await epochs(
        max_epochs=2,
        train_epoch=effects.train,
        validation_epoch=effects.validate,
        validate_before_training=True,
        return_min_validation_loss_model=range(2),
        validation_loss_exponential_smoothing_factor=0.5,
        early_stopping=lampdist.EarlyStopping(patience=1),
    )
    assert [kind for kind, _ in effects.calls] == ["valid", "train", "valid", "train", "valid"]
    first, *rest = state.learning_curve
    assert first.epoch == -1 and math.isnan(first.training_loss)
    assert (first.validation_loss, first.smoothed_validation_loss) == (5.0, None)
    assert first.metrics == {"validation_b_loss": 10.0}
    # it feeds no rule: the smoothing starts at epoch 0, the best and early stopping too
    assert [p.smoothed_validation_loss for p in rest] == [3.0, 3.5]
    assert (state.min_validation_loss, state.min_validation_epoch) == (3.0, 0)
    assert state.epoch == 2


async def test_a_resumed_run_and_a_run_without_validation_do_not_validate_first() -> None:
    effects = Recorder([3.0])
    resumed = LoopState(epoch=1, learning_curve=(lampdist.CurvePoint(epoch=0, training_loss=1.0),))
    state = await epochs(
        max_epochs=2,
        train_epoch=effects.train,
        validation_epoch=effects.validate,
        validate_before_training=True,
        init_state=resumed,
    )
    assert [kind for kind, _ in effects.calls] == ["train", "valid"]
    assert [p.epoch for p in state.learning_curve] == [0, 1]
    plain = Recorder([])
    state = await epochs(max_epochs=1, train_epoch=plain.train, validate_before_training=True)
    assert [p.epoch for p in state.learning_curve] == [0]


async def test_a_plateau_schedule_does_not_see_the_validation_before_training() -> None:
    seen: list[object] = []
    watched = Monitor("validation_b_loss")
    plateau = schedules.reduce_on_plateau(monitor=watched)

    class Watching:
        init = plateau.init
        monitor = watched

        def learning_rate_factor(self, state: object, epoch: int, value: object) -> object:
            seen.append(value)
            return plateau.learning_rate_factor(state, epoch, value)  # type: ignore[arg-type]

    effects = Recorder([5.0, 3.0])
    await epochs(
        max_epochs=1,
        train_epoch=effects.train,
        validation_epoch=effects.validate,
        validate_before_training=True,
        learning_rate_schedule=Watching(),  # type: ignore[arg-type]
    )
    assert seen == [None, 6.0]  # epoch 0 saw nothing, the end of epoch 0 its own value


def test_merge_sets_gives_the_driving_set_and_every_set_by_name() -> None:
    assert merge_sets([(None, 2.0, {})], None) == 2.0
    assert merge_sets([(None, 2.0, {"acc": 0.5})], None) == (2.0, {"acc": 0.5})
    outcomes = [("val", 2.0, {"acc": 0.5}), ("train", 1.0, {"acc": 0.9})]
    want = {"val_loss": 2.0, "val_acc": 0.5, "train_loss": 1.0, "train_acc": 0.9}
    assert merge_sets(outcomes, None) == (2.0, {"acc": 0.5, **want})
    assert merge_sets(outcomes, "train") == (1.0, {"acc": 0.9, **want})


def test_a_valid_command_carries_its_set_over_the_wire() -> None:
    command = Command(
        kind=CommandKind.VALID, epoch=1, pass_index=3, validation_set="val", share_result=True
    )
    assert Command.from_json(command.to_json()) == command
    plain = Command(kind=CommandKind.VALID, epoch=1, pass_index=3)
    assert plain.to_json() == {"kind": "valid", "epoch": 1, "pass_index": 3}
    with pytest.raises(lampdist.ConfigError, match="only a VALID"):
        Command(kind=CommandKind.TRAIN, epoch=1, pass_index=3, validation_set="val")
    with pytest.raises(lampdist.ProtocolError):
        Command.from_json({**command.to_json(), "share_result": "yes"})


def _event(validation_set: str | None) -> lampdist.PassEvent:
    return lampdist.PassEvent(
        epoch=0,
        kind="valid",
        pass_index=1,
        step=0,
        batches=2,
        total_batches=2,
        examples=8,
        loss=0.25,
        seconds=2.0,
        done=True,
        metrics={"acc": 0.5},
        validation_set=validation_set,
    )


def test_a_named_sets_event_is_recorded_under_its_name() -> None:
    assert event_scalars(_event(None)) == {
        "valid/loss": 0.25,
        "valid/examples_per_second": 4.0,
        "valid/acc": 0.5,
    }
    assert event_scalars(_event("val")) == {
        "valid/val/loss": 0.25,
        "valid/val/examples_per_second": 4.0,
        "valid/val/acc": 0.5,
    }
    assert list(event_record(_event(None), 3)) == list(EVENT_FIELDS)  # one source: as before
    assert event_record(_event("val"), 3)["validation_set"] == "val"
