"""The texts a failed step names: whose losses were not finite, a batch's shapes; and which
runs can gather every rank's own loss."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lampdist
from lampdist._epoch._blame import describe_batch, describe_losses
from lampdist._epoch._designs import DESIGNS, Solo
from lampdist._epoch._flat import FlatParameters
from lampdist._epoch._shard import check_closure_free
from lampdist._epoch._stepper import LossScale
from lampdist._options import StepOn

LOSSES = st.dictionaries(
    st.integers(min_value=0, max_value=40),
    st.floats(allow_nan=True, allow_infinity=True),
    min_size=1,
)


@given(losses=LOSSES)
def test_every_gathered_rank_whose_loss_was_not_finite_is_named(losses: dict[int, float]) -> None:
    nranks = max(losses) + 1
    complete = {rank: losses.get(rank, 0.0) for rank in range(nranks)}
    text = describe_losses(math.nan, complete, nranks=nranks)
    bad = sorted(rank for rank, value in complete.items() if not math.isfinite(value))
    named, _, total = text.partition(" (the summed loss")
    assert total == " of the step is nan)"
    if not bad:
        assert named == "every rank's own loss was finite, their sum was not"
        return
    ranks = re.sub(r" \([^)]*\)", "", re.split(r" was | were ", named)[0])
    ranks = ranks.removeprefix("the loss of rank ").removeprefix("the losses of ranks ")
    more = re.search(r" and (\d+) more$", ranks)
    if more is not None:
        ranks = ranks[: more.start()]
    listed = [int(rank) for rank in re.split(r", | and ", ranks)]
    assert listed == bad[:8]
    assert (0 if more is None else int(more.group(1))) == len(bad) - len(listed)


def test_a_rank_that_knows_only_its_own_loss_says_so() -> None:
    assert describe_losses(math.inf, {0: 2.5}, nranks=2) == (
        "the loss of rank 0 was finite, another rank's was not (the summed loss of the step "
        "is inf; the other ranks' own losses were not gathered)"
    )
    assert describe_losses(math.nan, {1: math.nan}, nranks=3) == (
        "the loss of rank 1 was nan (the summed loss of the step is nan; the other ranks' own "
        "losses were not gathered)"
    )
    assert describe_losses(math.nan, {0: math.nan}, nranks=1) == (
        "the loss of rank 0 was nan (the summed loss of the step is nan)"
    )


def test_many_ranks_are_counted_past_the_first_eight() -> None:
    losses = {rank: math.nan for rank in range(12)}
    assert describe_losses(math.nan, losses, nranks=12) == (
        "the losses of ranks 0, 1, 2, 3, 4, 5, 6, 7 and 4 more were nan (the summed loss of "
        "the step is nan)"
    )


def test_a_batch_is_described_by_its_shapes_and_dtypes() -> None:
    inputs = {
        "tokens": torch.zeros(16, 7, dtype=torch.int64),
        "extra": (torch.zeros(16, dtype=torch.bool), [torch.zeros(())]),
        "name": "x",
    }
    assert describe_batch(inputs, torch.zeros(16, 1)) == (
        "inputs {'tokens': int64[16, 7], 'extra': (bool[16], [float32[]]), 'name': str}, "
        "target float32[16, 1]"
    )
    assert describe_batch((torch.zeros(2, 3),), [torch.zeros(1)] * 10) == (
        "inputs (float32[2, 3],), target [float32[1], float32[1], float32[1], float32[1], "
        "float32[1], float32[1], float32[1], float32[1], ... 2 more]"
    )


CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize(
    ("device", "nranks", "step_on", "skips", "loss_scaling", "names"),
    [
        (CPU, 1, "root", False, False, False),  # alone: nothing to gather
        (CPU, 2, "root", False, False, True),
        (CPU, 2, "sharded", False, False, True),
        (CUDA, 2, "root", True, False, False),  # the followers do not read the root values
        (CUDA, 2, "root", False, True, True),  # they read the loss scale every step
        (CUDA, 2, "every_rank", False, False, False),  # the tally reads back later
        (CUDA, 2, "every_rank", True, False, True),
        (CUDA, 2, "sharded", False, True, True),
    ],
)
def test_which_runs_gather_every_ranks_own_loss(
    device: torch.device, nranks: int, step_on: StepOn, skips: bool, loss_scaling: bool, names: bool
) -> None:
    design = (Solo if nranks == 1 else DESIGNS[step_on])(
        rank=0,
        nranks=nranks,
        device=device,
        flat=FlatParameters.create(torch.nn.Linear(2, 1), CPU),
        options=lampdist.StepOptions(step_on=step_on, non_finite_loss="skip" if skips else "raise"),
        stepper=None,
        loss_scale=LossScale(enabled=loss_scaling),
    )
    assert design.names_every_rank() == names


class _Positional(torch.optim.SGD):
    def step(self, closure: Callable[[], float]) -> None:  # type: ignore[override]  # on purpose
        closure()


class _Optional(torch.optim.SGD):
    def step(self, closure: Callable[[], float] | None = None, *, extra: int = 0) -> None:  # type: ignore[override]  # on purpose
        super().step(closure)


def params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(2))]


@pytest.mark.parametrize(
    ("optimizer", "refused"),
    [
        (torch.optim.LBFGS(params()), True),
        (_Positional(params(), lr=0.1), True),
        (_Optional(params(), lr=0.1), False),
        (torch.optim.SGD(params(), lr=0.1), False),
        (torch.optim.Adafactor(params()), False),
    ],
    ids=["lbfgs", "positional", "optional", "sgd", "adafactor"],
)
def test_an_optimizer_is_refused_for_a_closure_it_cannot_do_without(
    optimizer: torch.optim.Optimizer, refused: bool
) -> None:
    if not refused:
        check_closure_free(3, optimizer)
        return
    with pytest.raises(lampdist.ConfigError) as caught:
        check_closure_free(3, optimizer)
    assert (caught.value.rank, caught.value.phase) == (3, "configure")
    assert caught.value.message.startswith(f"{type(optimizer).__name__}.step() needs a closure")
