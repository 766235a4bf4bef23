"""``StepOptions(global_accumulation=G)``: the accumulation summed over the ranks, so that n
ranks each accumulate G / n batches; refused when n does not divide it."""

from __future__ import annotations

import copy
from collections.abc import Iterable

import anyio
import pytest
import torch

import lampdist

from .reference import make_model, make_shards, mse

SIZES = {
    2: [[5, 7, 3, 9, 2, 4, 6, 1], [6, 6, 0, 4, 3, 5, 2, 7]],
    3: [[5, 7, 3, 9, 2, 4], [6, 6, 0, 4, 3, 5], [4, 0, 8, 2, 2, 3]],
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


async def trained(nranks: int, step: lampdist.StepOptions) -> list[torch.nn.Module]:
    """Every rank's module after two epochs of the local loop over :data:`SIZES`."""
    shards = make_shards(SIZES[nranks], seed=1)
    initial = make_model(seed=0)
    modules = [copy.deepcopy(initial) for _ in range(nranks)]
    with anyio.fail_after(60):
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(module, mse),
                    train_batches=lambda shard=shard: shard,
                )
                for module, shard in zip(modules, shards, strict=True)
            ],
            optimizer_factory=sgd,
            loop=lampdist.LoopOptions(max_epochs=2),
            step=step,
        )
    return modules


@pytest.mark.parametrize("nranks", [2, 3])
@pytest.mark.parametrize("step_on", ["root", "every_rank"])
async def test_a_global_count_trains_as_its_share_per_rank(nranks: int, step_on: str) -> None:
    per_rank = await trained(
        nranks,
        lampdist.StepOptions(accumulate_gradient_over_n_batches=2, step_on=step_on),  # type: ignore[arg-type]
    )
    global_ = await trained(
        nranks,
        lampdist.StepOptions(global_accumulation=2 * nranks, step_on=step_on),  # type: ignore[arg-type]
    )
    other = await trained(nranks, lampdist.StepOptions(step_on=step_on))  # type: ignore[arg-type]
    for got, want, single in zip(global_, per_rank, other, strict=True):
        for (name, a), b, c in zip(
            got.state_dict().items(),
            want.state_dict().values(),
            single.state_dict().values(),
            strict=True,
        ):
            assert torch.equal(a, b), name  # the same steps, bitwise
            assert not torch.equal(a, c), name  # and the count mattered


async def test_a_global_count_the_ranks_do_not_divide_is_refused() -> None:
    with pytest.raises(lampdist.ConfigError) as caught:
        await trained(3, lampdist.StepOptions(global_accumulation=4))
    message = str(caught.value)
    assert "global_accumulation=4" in message and "3 ranks" in message, message
    assert "3 or 6" in message, message  # what to pass instead


def test_a_global_and_a_per_rank_count_together_are_refused() -> None:
    with pytest.raises(lampdist.ConfigError) as caught:
        lampdist.StepOptions(global_accumulation=4, accumulate_gradient_over_n_batches=2)
    message = str(caught.value)
    assert "global_accumulation=4" in message, message
    assert "accumulate_gradient_over_n_batches=2" in message, message


def test_per_rank_resolves_the_global_count_once() -> None:
    step = lampdist.StepOptions(global_accumulation=6)
    assert step.per_rank(3) == lampdist.StepOptions(accumulate_gradient_over_n_batches=2)
    plain = lampdist.StepOptions(accumulate_gradient_over_n_batches=5)
    assert plain.per_rank(4) is plain
    with pytest.raises(lampdist.ConfigError, match="global_accumulation"):
        lampdist.StepOptions(global_accumulation=0)
