"""The built-in schedules of the libraries users come from, bit for bit: transformers' against
transformers' own ``LambdaLR`` at every step of a 1,000-step run, torchtitan's against the
formula of its source, transcribed below."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import optimization as hf

import lampdist
from lampdist import schedules

STEPS = 1000
BASE_LR = 3e-4


def _lambda_lr(make: Callable[..., Any], **kwargs: Any) -> list[tuple[float, float]]:
    """transformers' scheduler over :data:`STEPS` steps: (its lambda's factor, the learning
    rate ``LambdaLR`` set) at each step, as a training loop sees them before its step."""
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=BASE_LR)
    scheduler = make(optimizer, **kwargs)
    (factor_of,) = scheduler.lr_lambdas
    seen = []
    for step in range(STEPS):
        seen.append((factor_of(step), optimizer.param_groups[0]["lr"]))
        optimizer.step()
        scheduler.step()
    return seen


def _same_bits(ours: float, theirs: float) -> bool:
    return float(ours).hex() == float(theirs).hex()


def _assert_matches(schedule: lampdist.schedules.StepSchedule, theirs: list[Any]) -> None:
    for step, (factor, lr) in enumerate(theirs):
        mine = schedule.factor(step)
        assert _same_bits(mine, factor), (step, mine, factor)
        # what lampdist's step sets: the base rate times (the epoch factor 1.0 times) it
        assert _same_bits(BASE_LR * (1.0 * mine), lr), (step, BASE_LR * mine, lr)


LINEAR = [(0, 1000), (100, 1000), (37, 700), (1, 1), (250, 250), (0, 0)]
COSINE = [(100, 1000, 0.5), (0, 1000, 0.5), (100, 1000, 1.0), (50, 600, 2.5), (10, 990, 0.25)]
CONSTANT = [0, 1, 100, 999, 1500]


@pytest.mark.parametrize(("warmup", "total"), LINEAR)
def test_linear_with_warmup_is_transformers_bit_for_bit(warmup: int, total: int) -> None:
    theirs = _lambda_lr(
        hf.get_linear_schedule_with_warmup, num_warmup_steps=warmup, num_training_steps=total
    )
    _assert_matches(schedules.transformers_linear_with_warmup(warmup, total), theirs)


@pytest.mark.parametrize(("warmup", "total", "cycles"), COSINE)
def test_cosine_with_warmup_is_transformers_bit_for_bit(
    warmup: int, total: int, cycles: float
) -> None:
    theirs = _lambda_lr(
        hf.get_cosine_schedule_with_warmup,
        num_warmup_steps=warmup,
        num_training_steps=total,
        num_cycles=cycles,
    )
    _assert_matches(schedules.transformers_cosine_with_warmup(warmup, total, cycles), theirs)


@pytest.mark.parametrize("warmup", CONSTANT)
def test_constant_with_warmup_is_transformers_bit_for_bit(warmup: int) -> None:
    theirs = _lambda_lr(hf.get_constant_schedule_with_warmup, num_warmup_steps=warmup)
    _assert_matches(schedules.transformers_constant_with_warmup(warmup), theirs)


WSD = [
    {"warmup_type": w, "decay_type": d, "min_lr_ratio": m}
    for w in ("linear", "cosine", "1-sqrt")
    for d in ("linear", "cosine", "1-sqrt")
    for m in (0.0, 0.1)
]


@pytest.mark.parametrize("kinds", WSD, ids=lambda k: "-".join(map(str, k.values())))
@pytest.mark.parametrize(
    "lengths",
    [
        {"num_warmup_steps": 100, "num_decay_steps": 300, "num_training_steps": 1000},
        {"num_warmup_steps": 50, "num_decay_steps": 200, "num_stable_steps": 250},  # ends at 500
        {"num_warmup_steps": 0, "num_decay_steps": 1000, "num_training_steps": 1000},
    ],
    ids=["training", "stable", "no-warmup"],
)
def test_wsd_is_transformers_bit_for_bit(lengths: dict[str, Any], kinds: dict[str, Any]) -> None:
    theirs = _lambda_lr(hf.get_wsd_schedule, **lengths, **kinds)
    _assert_matches(schedules.transformers_wsd(**lengths, **kinds), theirs)


@pytest.mark.parametrize("cycles", [1.0, 1.5])
def test_wsd_num_cycles_is_transformers_bit_for_bit(cycles: float) -> None:
    lengths: dict[str, Any] = {
        "num_warmup_steps": 10,
        "num_decay_steps": 900,
        "num_training_steps": 1000,
    }
    theirs = _lambda_lr(hf.get_wsd_schedule, **lengths, num_cycles=cycles)
    _assert_matches(schedules.transformers_wsd(**lengths, num_cycles=cycles), theirs)


# --- torchtitan -----------------------------------------------------------------------------
# Transcribed from torchtitan's source, pytorch/torchtitan,
# torchtitan/components/optimizer/lr_scheduler.py (LRSchedulersContainer.Config.build and its
# linear_warmup_stable_decay, as of commit b5bcd76, August 2026; the same formula since commit
# e7c0cae, "Redefine lr_scheduler behavior" #1284, June 2025, in every release from v0.1.0), and
# the formula before that commit (torchtitan/components/lr_scheduler.py at e7c0cae^). Only
# the logger calls are left out.


def _titan_current(
    total_steps: int,
    warmup_steps: int,
    decay_ratio: float | None,
    decay_type: str,
    min_lr_factor: float,
) -> Callable[[int], float]:
    warmup_steps = min(warmup_steps, total_steps)
    if decay_ratio is not None:
        decay_steps = round(total_steps * decay_ratio)
        if warmup_steps + decay_steps > total_steps:
            decay_steps = total_steps - warmup_steps
    else:
        decay_steps = total_steps - warmup_steps
    # Add a virtual last step to prevent the learning rate from dropping to 0
    stable_steps = total_steps + 1 - warmup_steps - decay_steps

    def linear_warmup_stable_decay(
        current_step: int,
        warmup_steps: int,
        stable_steps: int,
        decay_steps: int,
        lr_decay_type: str,
        min_lr_factor: float,
    ) -> float:
        warmup_stable_steps = warmup_steps + stable_steps
        if current_step < warmup_steps:
            current_step += 1
            assert warmup_steps != 0
            curr_adjustment = float(current_step / warmup_steps)
        elif current_step < warmup_stable_steps:
            curr_adjustment = 1.0
        else:
            current_step += 1
            assert decay_steps != 0
            progress = float(current_step - warmup_stable_steps) / decay_steps
            if lr_decay_type == "linear":
                curr_adjustment = 1 - progress
            elif lr_decay_type == "sqrt":
                curr_adjustment = 1 - math.sqrt(progress)
            elif lr_decay_type == "cosine":
                curr_adjustment = 0.5 * (1.0 + math.cos(math.pi * progress))
            else:
                raise ValueError(f"Unknown lr_decay_type: {lr_decay_type}")
            curr_adjustment = min_lr_factor + (1 - min_lr_factor) * curr_adjustment
        return curr_adjustment

    return functools.partial(
        linear_warmup_stable_decay,
        warmup_steps=warmup_steps,
        stable_steps=stable_steps,
        decay_steps=decay_steps,
        lr_decay_type=decay_type,
        min_lr_factor=min_lr_factor,
    )


def _titan_legacy(
    training_steps: int,
    warmup_steps: int,
    decay_ratio: float | None,
    decay_type: str,
    lr_min: float,
) -> Callable[[int], float]:
    if decay_ratio is not None:
        decay_steps = round(training_steps * decay_ratio)
        if warmup_steps + decay_steps > training_steps:
            decay_steps = training_steps - warmup_steps
    else:
        decay_steps = training_steps - warmup_steps
    stable_steps = training_steps - warmup_steps - decay_steps

    def linear_warmup_stable_decay(
        current_step: int,
        warmup_steps: int,
        stable_steps: int,
        decay_steps: int,
        lr_decay_type: str,
        lr_min: float,
    ) -> float:
        warmup_stable_steps = warmup_steps + stable_steps
        if current_step < warmup_steps:
            current_step += 1
            curr_adjustment = float(current_step / (warmup_steps + 1))
        elif current_step < warmup_stable_steps:
            curr_adjustment = 1.0
        else:
            current_step += 1
            progress = float(current_step - warmup_stable_steps) / (decay_steps + 1)
            if lr_decay_type == "linear":
                curr_adjustment = 1 - progress
            elif lr_decay_type == "sqrt":
                curr_adjustment = 1 - math.sqrt(progress)
            elif lr_decay_type == "cosine":
                curr_adjustment = 0.5 * (1.0 + math.cos(math.pi * progress))
            curr_adjustment = lr_min + (1 - lr_min) * curr_adjustment
        return curr_adjustment

    return functools.partial(
        linear_warmup_stable_decay,
        warmup_steps=warmup_steps,
        stable_steps=stable_steps,
        decay_steps=decay_steps,
        lr_decay_type=decay_type,
        lr_min=lr_min,
    )


TITAN = [
    (warmup, ratio, decay, low)
    for warmup in (0, 1, 200)
    for ratio in (None, 0.8, 0.3, 0.0)
    for decay in ("linear", "sqrt", "cosine")
    for low in (0.0, 0.1)
]


@pytest.mark.parametrize("legacy", [False, True], ids=["current", "legacy"])
@pytest.mark.parametrize(("warmup", "ratio", "decay", "low"), TITAN)
def test_torchtitan_warmup_stable_decay_is_its_formula_bit_for_bit(
    legacy: bool, warmup: int, ratio: float | None, decay: str, low: float
) -> None:
    theirs = (_titan_legacy if legacy else _titan_current)(STEPS, warmup, ratio, decay, low)
    ours = schedules.torchtitan_warmup_stable_decay(
        warmup,
        STEPS,
        decay_ratio=ratio,
        decay_type=decay,  # type: ignore[arg-type]  # parametrized
        min_lr_factor=low,
        legacy=legacy,
    )
    for step in range(STEPS + 1):  # up to the step after the last, where it is held
        assert _same_bits(ours.factor(step), theirs(step)), (step, ours.factor(step))
    assert ours.factor(STEPS + 5) == ours.factor(STEPS)


def test_torchtitan_warms_up_as_documented() -> None:
    """The warm-up of each convention against the issue's numbers: (s+1)/W today,
    (s+1)/(W+1) before June 2025; transformers' s/W."""
    current = schedules.torchtitan_warmup_stable_decay(4, 100)
    legacy = schedules.torchtitan_warmup_stable_decay(4, 100, legacy=True)
    hf_style = schedules.transformers_linear_with_warmup(4, 100)
    assert [current.factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert [legacy.factor(s) for s in range(4)] == [0.2, 0.4, 0.6, 0.8]
    assert [hf_style.factor(s) for s in range(4)] == [0.0, 0.25, 0.5, 0.75]


@pytest.mark.parametrize(("warmup", "total", "final"), [(10, 1000, 0.0), (100, 1000, 0.1)])
def test_warmup_cosine_steps_is_torchtitans_cosine(warmup: int, total: int, final: float) -> None:
    """What warmup_cosine_steps' docstring says: torchtitan's cosine schedule (v0.1.0 and
    after, no decay_ratio), bit for bit."""
    theirs = _titan_current(total, warmup, None, "cosine", final)
    ours = schedules.warmup_cosine_steps(warmup, total, final)
    assert all(_same_bits(ours.factor(s), theirs(s)) for s in range(total + 1))


def test_warmup_linear_steps_is_torchtitans_linear_down_to_zero() -> None:
    theirs = _titan_current(1000, 100, None, "linear", 0.0)
    ours = schedules.warmup_linear_steps(100, 1000)
    assert all(_same_bits(ours.factor(s), theirs(s)) for s in range(1001))


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: schedules.transformers_linear_with_warmup(-1, 10), "num_warmup_steps"),
        (lambda: schedules.transformers_cosine_with_warmup(1, 10, math.nan), "num_cycles"),
        (lambda: schedules.transformers_constant_with_warmup(1.5), "num_warmup_steps"),  # type: ignore[arg-type]  # on purpose
        (lambda: schedules.transformers_wsd(1, 2), "exactly one of num_training_steps"),
        (lambda: schedules.transformers_wsd(1, 2, 10, 7), "exactly one of num_training_steps"),
        (lambda: schedules.transformers_wsd(5, 6, 10), "num_training_steps must be an int >= 11"),
        (lambda: schedules.transformers_wsd(1, 2, 10, warmup_type="exp"), "warmup_type"),  # type: ignore[arg-type]  # on purpose
        (lambda: schedules.transformers_wsd(1, 2, 10, min_lr_ratio=2), "min_lr_ratio"),
        (lambda: schedules.torchtitan_warmup_stable_decay(11, 10), "warmup_steps=10"),
        (lambda: schedules.torchtitan_warmup_stable_decay(1, 10, decay_ratio=1.5), "decay_ratio"),
        (
            lambda: schedules.torchtitan_warmup_stable_decay(1, 10, decay_type="exp"),  # type: ignore[arg-type]  # on purpose
            "decay_type",
        ),
    ],
)
def test_bad_arguments_are_refused_naming_them(build: Callable[[], Any], match: str) -> None:
    with pytest.raises(lampdist.ConfigError, match=match):
        build()
