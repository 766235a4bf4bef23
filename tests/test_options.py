"""The option objects refuse a bad value of each field when they are built, naming the field."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

import lampdist
from lampdist import EarlyStopping, LoopOptions, Monitor, StepOptions, schedules


async def _checkpoint(training_state: object, lr_state: object, /) -> None:
    pass


STEP_BAD = [
    ("accumulate_gradient_over_n_batches", 0),
    ("global_accumulation", 0),
    ("autocast_dtype", torch.float64),
    ("step_on", "everywhere"),
    ("bucket_cap_mb", 0),
    ("max_grad_norm", "1.0"),
    ("measure_grad_norm", 1),
    ("grad_norm_every", 0),
    ("measure_step_split", "yes"),
    ("non_finite_loss", "ignore"),
    ("shuffle_seed", 1.5),
    ("steps_per_epoch", True),
    ("learning_rate_per_step", schedules.linear(1.0, 0.0, 10)),
    ("fsdp", "blocks"),
]

LOOP_BAD = [
    ("max_epochs", 2.0),
    ("validation_frequency", 0),
    ("validation_loss_exponential_smoothing_factor", 1.5),
    ("learning_rate_schedule", 0.1),
    ("return_min_validation_loss_model", 3),
    ("checkpoint_state", "checkpoints/"),
    ("checkpoint_interval", -60.0),
    ("on_event", "print"),
    ("best_model_monitor", "validation_accuracy"),
    ("early_stopping", Monitor()),
    ("recovery", 30.0),
    ("log_every_n_steps", 0),
    ("peak_flops", 0.0),
    ("validation_set", "not a name"),
    ("validate_before_training", "yes"),
]


def _fields(cls: type[Any]) -> list[str]:
    """The fields, less those kept only for a deprecated name (tested below)."""
    return [field.name for field in attrs.fields(cls) if not field.metadata.get("deprecated")]


def test_every_field_has_a_bad_value_below() -> None:
    assert [name for name, _ in STEP_BAD] == _fields(StepOptions)
    assert [name for name, _ in LOOP_BAD] == _fields(LoopOptions)


@pytest.mark.parametrize(("field", "value"), STEP_BAD)
def test_step_options_refuse_a_bad_value_naming_the_field(field: str, value: object) -> None:
    arguments: dict[str, Any] = {field: value}
    with pytest.raises(lampdist.ConfigError, match=rf"StepOptions\.{field} ") as caught:
        StepOptions(**arguments)
    assert caught.value.phase == "configure"
    assert repr(value) in caught.value.message
    assert "pass" in caught.value.message  # and what to pass instead


@pytest.mark.parametrize(("field", "value"), LOOP_BAD)
def test_loop_options_refuse_a_bad_value_naming_the_field(field: str, value: object) -> None:
    arguments: dict[str, Any] = {"max_epochs": 1, field: value}
    with pytest.raises(lampdist.ConfigError, match=rf"LoopOptions\.{field} ") as caught:
        LoopOptions(**arguments)
    assert caught.value.phase == "configure"
    assert repr(value) in caught.value.message
    assert "pass" in caught.value.message


def test_the_values_that_train_are_accepted() -> None:
    StepOptions(
        accumulate_gradient_over_n_batches=2,
        autocast_dtype=torch.bfloat16,
        step_on="sharded",
        bucket_cap_mb=25,
        max_grad_norm=1,
        non_finite_loss="skip",
        shuffle_seed=-3,
        steps_per_epoch=4,
        learning_rate_per_step=schedules.warmup_linear_steps(1, 5),
    )
    loop = LoopOptions(
        max_epochs=0,
        validation_frequency=3,
        validation_loss_exponential_smoothing_factor=1,
        learning_rate_schedule=schedules.warmup(2, schedules.cosine(10)),
        return_min_validation_loss_model=(epoch for epoch in (1, 2)),
        checkpoint_state=_checkpoint,
        checkpoint_interval=30,
        on_event=None,
        best_model_monitor=Monitor("validation_accuracy", "max"),
        early_stopping=EarlyStopping(),
    )
    assert loop.return_min_validation_loss_model == frozenset({1, 2})


def test_fields_that_need_each_other_are_checked_together() -> None:
    with pytest.raises(lampdist.ConfigError, match="learning_rate_per_step needs steps_per_epoch"):
        StepOptions(learning_rate_per_step=schedules.warmup_linear_steps(1, 5))
    with pytest.raises(lampdist.ConfigError, match=r"checkpoint_interval .* no checkpoint_state"):
        LoopOptions(max_epochs=1, checkpoint_interval=60.0)


# -- the switches renamed from their measurements' names -----------------------------------------


@pytest.mark.parametrize(
    ("old", "new", "value"),
    [("grad_norm", "measure_grad_norm", True), ("step_split", "measure_step_split", False)],
)
def test_a_switch_by_its_old_name_still_works_warned(old: str, new: str, value: bool) -> None:
    by_old: dict[str, Any] = {old: value}
    by_new: dict[str, Any] = {new: value}
    with pytest.warns(DeprecationWarning, match=f"StepOptions.{old} is now StepOptions.{new}"):
        options = lampdist.StepOptions(**by_old)
    assert getattr(options, new) is value
    assert options == lampdist.StepOptions(**by_new)
    assert repr(options) == repr(lampdist.StepOptions(**by_new))
    assert options.agreed_fields() == lampdist.StepOptions(**by_new).agreed_fields()
    with pytest.warns(DeprecationWarning, match=f"StepOptions.{old} is now"):
        assert getattr(options, old) is value
    flipped: dict[str, Any] = {new: not value}
    evolved = attrs.evolve(options, **flipped)  # no old name to take again
    assert getattr(evolved, new) is (not value)


def test_a_switch_by_its_old_name_takes_bools_only() -> None:
    with (
        pytest.warns(DeprecationWarning, match="grad_norm"),
        pytest.raises(lampdist.ConfigError, match="measure_grad_norm must be a bool"),
    ):
        lampdist.StepOptions(grad_norm=1)  # type: ignore[arg-type]  # the point of the test
