"""``step_on="sharded"``: each rank steps its own slice with its own optimizer state, and the
run trains exactly like one process with the whole optimizer."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import anyio
import pytest
import torch

import lampdist
from lampdist._epoch import FlatParameters
from lampdist._epoch._shard import ShardedOptimizer

from .reference import make_model, make_shards, mse, reference_training


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


Factory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def grouped(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """Two groups with their own learning rate and weight decay: the weights, the biases."""
    params = list(params)
    weights = [p for p in params if p.dim() > 1]
    biases = [p for p in params if p.dim() == 1]
    return torch.optim.AdamW(
        [
            {"params": weights, "weight_decay": 0.1},
            {"params": biases, "lr": 0.003, "weight_decay": 0.0},
        ],
        lr=0.01,
    )


OPTIMIZERS: dict[str, Factory] = {
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "adam-fused": lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
    "adamw-foreach-amsgrad": lambda p: torch.optim.AdamW(p, lr=0.01, foreach=True, amsgrad=True),
    "adamw-for-loop": lambda p: torch.optim.AdamW(p, lr=0.01, foreach=False),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01),
    "rmsprop-centered": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
    "adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
    "adamax": lambda p: torch.optim.Adamax(p, lr=0.01),
    "asgd": lambda p: torch.optim.ASGD(p, lr=0.05, t0=2),
    "nadam": lambda p: torch.optim.NAdam(p, lr=0.01),
    "radam": lambda p: torch.optim.RAdam(p, lr=0.01),
    "rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
    "groups-lr-weight-decay": grouped,
}


async def _train(
    factory: Factory, sizes: list[list[int]], *, width: int = 6
) -> list[torch.nn.Module]:
    train = make_shards(sizes, seed=1)
    modules = [make_model(seed=0, width=width)] + [
        make_model(seed=10 + rank, width=width) for rank in range(1, len(sizes))
    ]
    with anyio.fail_after(60):
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(module, mse),
                    train_batches=(lambda t=t: list(t)),
                )
                for module, t in zip(modules, train, strict=True)
            ],
            optimizer_factory=factory,
            loop=lampdist.LoopOptions(max_epochs=2),
            step=lampdist.StepOptions(step_on="sharded", bucket_cap_mb=1e-4),
        )
    return modules


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
async def test_every_elementwise_optimizer_steps_slices_like_the_whole(name: str) -> None:
    """Three ranks on uneven shards, buffers cut into buckets so that parameters straddle
    the slices: the weights of one process stepping the whole optimizer."""
    sizes = [[5, 7, 3, 9], [6, 6, 2], [4, 0, 8]]
    factory = OPTIMIZERS[name]
    expected, _, _ = reference_training(
        make_model(seed=0, width=7), factory, make_shards(sizes, seed=1), None, epochs=2
    )
    modules = await _train(factory, sizes, width=7)
    for module in modules:
        for (key, got), want in zip(
            module.state_dict().items(), expected.state_dict().values(), strict=True
        ):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-9, msg=key)


class _Custom(torch.optim.SGD):
    """A subclass of an elementwise optimizer: its step may do anything."""


@pytest.mark.parametrize(
    ("factory", "name"),
    [
        (torch.optim.Adafactor, "Adafactor"),
        (lambda p: _Custom(p, lr=0.1), "_Custom"),
    ],
    ids=["adafactor", "subclass"],
)
async def test_an_optimizer_that_needs_whole_tensors_is_refused_before_training(
    factory: Factory, name: str
) -> None:
    batches_taken: list[int] = []

    def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
        batches_taken.append(1)
        return make_shards([[4]], seed=1)[0]

    with pytest.raises(
        lampdist.ConfigError, match=rf"step_on='sharded'.*{name} is not one"
    ) as info:
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(make_model(seed=r), mse), train_batches=batches
                )
                for r in range(2)
            ],
            optimizer_factory=factory,
            loop=lampdist.LoopOptions(max_epochs=1),
            step=lampdist.StepOptions(step_on="sharded"),
        )
    assert info.value.phase == "configure"
    assert "step_on='every_rank'" in info.value.message
    assert batches_taken == []


async def test_an_optimizer_over_other_tensors_is_refused() -> None:
    stray = torch.zeros(3, requires_grad=True)
    with pytest.raises(lampdist.ConfigError, match="not one of the model's trainable parameters"):
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(make_model(seed=r), mse),
                    train_batches=lambda: make_shards([[4]], seed=1)[0],
                )
                for r in range(2)
            ],
            optimizer_factory=lambda p: torch.optim.SGD([*p, stray], lr=0.1),
            loop=lampdist.LoopOptions(max_epochs=1),
            step=lampdist.StepOptions(step_on="sharded"),
        )


def test_each_rank_holds_only_its_slice_of_the_optimizer_state() -> None:
    """Adam's state on each of 3 ranks: a third of the whole (to the padding), every element
    on exactly one rank."""
    module = make_model(seed=0, width=40)
    whole = sum(p.numel() for p in module.parameters())
    flat = FlatParameters.create(module, torch.device("cpu"), shards=3)
    held = []
    for rank in range(3):
        shard = ShardedOptimizer.create(rank, torch.optim.Adam(flat.parameters, lr=0.01), flat)
        for grads in shard.gradients():
            grads.fill_(0.5)
        shard.optimizer.step()
        held.append(
            sum(
                value.numel()
                for state in shard.optimizer.state.values()
                for key, value in state.items()
                if key != "step"
            )
        )
    assert sum(held) == 2 * whole  # exp_avg and exp_avg_sq, each element once
    assert max(held) <= 2 * -(-whole // 3)
