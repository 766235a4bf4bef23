"""What a failed step names, in the single-process loop: the ranks whose own loss was not
finite (every design, a rank alone, both policies), the batch a model raised on, and an
optimizer that needs a closure, refused before any pass."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence

import anyio
import attrs
import pytest
import torch

import lampdist
import lampdist._options

from .reference import Batch, make_model, make_shards, mse

DESIGNS: list[lampdist._options.StepOn] = ["root", "every_rank", "sharded"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def poisoned_at(step: int, value: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A loss that is ``value`` at the rank's ``step``-th batch of each pass (one batch a step)."""
    calls = 0

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return mse(output, target) * (value if (calls - 1) % 3 == step else 1.0)

    return loss


def streams(
    nranks: int, losses: dict[int, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]
) -> list[lampdist.ModelWithData]:
    shards = make_shards([[4, 4, 4]] * nranks, seed=7)
    return [
        lampdist.ModelWithData(
            model=lampdist.SupervisedModel(make_model(), losses.get(rank, mse)),
            train_batches=lambda shard=shard: list(shard),
        )
        for rank, shard in enumerate(shards)
    ]


async def train(
    data: Sequence[lampdist.ModelWithData],
    step: lampdist.StepOptions,
    optimizer_factory: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] = sgd,
) -> lampdist.LoopState:
    with anyio.fail_after(30):
        return await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=data,
            optimizer_factory=optimizer_factory,
            loop=lampdist.LoopOptions(max_epochs=1),
            step=step,
        )


BLAMED = [
    (2, {1: math.nan}, "the loss of rank 1 was nan (the summed loss of the step is nan)"),
    (2, {1: math.inf}, "the loss of rank 1 was inf (the summed loss of the step is inf)"),
    (
        3,
        {1: math.nan, 2: math.nan},
        "the losses of ranks 1 and 2 were nan (the summed loss of the step is nan)",
    ),
    (
        3,
        {0: math.inf, 2: -math.inf},
        "the losses of ranks 0 (inf) and 2 (-inf) were not finite (the summed loss of the "
        "step is nan)",
    ),
]


@pytest.mark.parametrize("bucket_cap_mb", [None, 1e-4], ids=["whole", "buckets"])
@pytest.mark.parametrize("step_on", DESIGNS)
@pytest.mark.parametrize(("nranks", "bad", "named"), BLAMED)
async def test_a_non_finite_loss_names_the_ranks_it_came_from(
    nranks: int,
    bad: dict[int, float],
    named: str,
    step_on: lampdist._options.StepOn,
    bucket_cap_mb: float | None,
) -> None:
    losses = {rank: poisoned_at(1, value) for rank, value in bad.items()}
    step = lampdist.StepOptions(step_on=step_on, bucket_cap_mb=bucket_cap_mb)
    with pytest.raises(lampdist.NonFiniteLoss) as caught:
        await train(streams(nranks, losses), step)
    # With every_rank and sharded every rank raises it; whichever comes out names the ranks.
    assert caught.value.message.startswith(f"epoch 0, step 1: {named}; pass non_finite_loss=")
    assert caught.value.phase == "train"
    if step_on == "root":
        assert caught.value.rank == 0


@pytest.mark.parametrize("step_on", DESIGNS)
async def test_the_skip_warning_names_the_ranks(
    step_on: lampdist._options.StepOn, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="lampdist._epoch")
    losses = {rank: poisoned_at(2, math.nan) for rank in (1, 2)}
    state = await train(
        streams(3, losses), lampdist.StepOptions(step_on=step_on, non_finite_loss="skip")
    )
    assert math.isfinite(state.learning_curve[0].training_loss)
    warnings = [r.getMessage() for r in caplog.records if "skipping the step" in r.getMessage()]
    # Every stepping rank skips the step and says so: the root, or with every_rank and
    # sharded every rank.
    assert len(warnings) == (1 if step_on == "root" else 3)
    for message in warnings:
        assert message == (
            "epoch 0, step 2: skipping the step: the losses of ranks 1 and 2 were nan (the "
            "summed loss of the step is nan)"
        )


@pytest.mark.parametrize("policy", ["raise", "skip"])
async def test_a_rank_alone_names_itself(policy: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="lampdist._epoch")
    data = streams(1, {0: poisoned_at(1, math.nan)})
    named = "the loss of rank 0 was nan (the summed loss of the step is nan)"
    if policy == "raise":
        with pytest.raises(lampdist.NonFiniteLoss) as caught:
            await train(data, lampdist.StepOptions())
        assert caught.value.rank == 0
        assert caught.value.message.startswith(f"epoch 0, step 1: {named}; pass ")
        return
    await train(data, lampdist.StepOptions(non_finite_loss="skip"))
    warnings = [r.getMessage() for r in caplog.records if "skipping the step" in r.getMessage()]
    assert warnings == [f"epoch 0, step 1: skipping the step: {named}"]


def wide_batch_at(index: int, shard: Sequence[Batch]) -> list[Batch]:
    """``shard`` with its ``index``-th batch's inputs one column too wide."""
    batches = list(shard)
    inputs, target = batches[index]
    batches[index] = (torch.cat([inputs, inputs[:, :1]], dim=1), target)
    return batches


@pytest.mark.parametrize("nranks", [1, 2])
async def test_a_batch_of_the_wrong_shape_names_the_rank_batch_and_shapes(nranks: int) -> None:
    data = streams(nranks, {})
    rank = nranks - 1
    shard = make_shards([[4, 4, 4, 4]], seed=3)[0]
    data[rank] = attrs.evolve(data[rank], train_batches=lambda: wide_batch_at(2, shard))
    with pytest.raises(lampdist.TrainingError) as caught:
        await train(data, lampdist.StepOptions(accumulate_gradient_over_n_batches=2))
    assert (caught.value.rank, caught.value.phase) == (rank, "train")
    message = caught.value.message
    assert message.startswith("epoch 0, batch 2: the model raised RuntimeError: mat1 and mat2")
    assert message.endswith("(inputs float64[4, 4], target float64[4, 1])")


async def test_the_batch_index_counts_from_each_window() -> None:
    """With steps_per_epoch one stream feeds every epoch: the index is within the epoch's
    window (the 7th batch of the stream is the 2nd of the third window of 3 batches)."""
    data = streams(2, {})
    shard = make_shards([[4] * 9], seed=3)[0]
    data[1] = attrs.evolve(data[1], train_batches=lambda: wide_batch_at(7, shard))
    with pytest.raises(lampdist.TrainingError) as caught:
        with anyio.fail_after(30):
            await lampdist.local_data_parallel_training_loop(
                models_with_data_streams=data,
                optimizer_factory=sgd,
                loop=lampdist.LoopOptions(max_epochs=3),
                step=lampdist.StepOptions(steps_per_epoch=3),
            )
    assert caught.value.rank == 1
    assert caught.value.message.startswith("epoch 2, batch 1: the model raised RuntimeError")


async def test_a_validation_batch_of_the_wrong_shape_is_named_too() -> None:
    data = streams(2, {})
    shard = make_shards([[4, 4, 4]], seed=3)[0]
    data[1] = attrs.evolve(data[1], validation_batches=lambda: wide_batch_at(1, shard))
    data[0] = attrs.evolve(data[0], validation_batches=lambda: list(shard))
    with pytest.raises(lampdist.TrainingError) as caught:
        await train(data, lampdist.StepOptions())
    assert (caught.value.rank, caught.value.phase) == (1, "valid")
    assert caught.value.message.startswith("epoch 0, batch 1: the model raised RuntimeError")


class _NeedsClosure(torch.optim.SGD):
    """An optimizer whose step takes a keyword-only closure without a default."""

    def step(self, *, closure: Callable[[], float]) -> None:  # type: ignore[override]  # on purpose
        closure()


class _TakesClosure(torch.optim.SGD):
    """An optimizer whose step takes a closure it can do without."""

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]  # on purpose
        super().step(closure)


@pytest.mark.parametrize("nranks", [1, 2])
@pytest.mark.parametrize("step_on", DESIGNS)
@pytest.mark.parametrize(
    ("factory", "name"),
    [
        (torch.optim.LBFGS, "LBFGS"),
        (lambda p: _NeedsClosure(p, lr=0.1), "_NeedsClosure"),
    ],
    ids=["lbfgs", "keyword-only"],
)
async def test_an_optimizer_that_needs_a_closure_is_refused_before_training(
    factory: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
    name: str,
    step_on: lampdist._options.StepOn,
    nranks: int,
) -> None:
    taken: list[int] = []

    def batches() -> list[Batch]:
        taken.append(1)
        return make_shards([[4]], seed=1)[0]

    data = [attrs.evolve(entry, train_batches=batches) for entry in streams(nranks, {})]
    with pytest.raises(lampdist.ConfigError) as caught:
        await train(data, lampdist.StepOptions(step_on=step_on), factory)
    assert caught.value.phase == "configure"
    assert caught.value.message.startswith(f"{name}.step() needs a closure")
    assert "use an optimizer that steps without a closure (SGD, Adam, AdamW" in str(caught.value)
    assert taken == []


async def test_an_optimizer_whose_closure_is_optional_trains() -> None:
    state = await train(streams(2, {}), lampdist.StepOptions(), lambda p: _TakesClosure(p, lr=0.1))
    assert math.isfinite(state.learning_curve[0].training_loss)
