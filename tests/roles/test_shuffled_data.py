"""Shuffled data is exact: a batch source told its pass (epoch, rank, a seed of its own)
shuffles in the same order in every run, uninterrupted or resumed (the runs of two
processes are in test_tcp_exactness.py)."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import lampdist
from lampdist import checkpoint
from lampdist._source import pass_seed

from .reference import Batch, make_model, make_shards, mse, shuffled


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def adamw(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05)


class Interrupt(Exception):
    pass


TRAIN = make_shards([[6, 5, 7, 4], [4, 8, 3]], seed=31)
VALID = make_shards([[6], [5]], seed=32)
EPOCHS = 4


async def train(
    *,
    seed: int = 0,
    directory: Path | None = None,
    interrupt_after: int | None = None,
    resume: lampdist.Resumed | None = None,
    model_seed: int = 0,
) -> list[torch.nn.Module]:
    """``EPOCHS`` epochs of two in-process ranks on shuffled loaders; checkpoints into
    ``directory`` if given, interrupted after the checkpoint of epoch ``interrupt_after``."""
    modules = [make_model(seed=model_seed), make_model(seed=model_seed + 1)]
    write = checkpoint.to_directory(directory) if directory is not None else None

    async def checkpoint_then_maybe_stop(state: lampdist.TrainingState, lr_state: Any) -> None:
        assert write is not None
        await write(state, lr_state)
        if state.loop_state.epoch == interrupt_after:
            raise Interrupt

    try:
        with anyio.fail_after(60):
            await lampdist.local_data_parallel_training_loop(
                models_with_data_streams=[
                    lampdist.ModelWithData(
                        model=lampdist.SupervisedModel(module, mse),
                        train_batches=shuffled(shard, batch_size=3),
                        validation_batches=shuffled(valid, batch_size=2),
                    )
                    for module, shard, valid in zip(modules, TRAIN, VALID, strict=True)
                ],
                optimizer_factory=adamw,
                resume=resume,
                loop=lampdist.LoopOptions(
                    max_epochs=EPOCHS,
                    checkpoint_state=checkpoint_then_maybe_stop if write is not None else None,
                    return_min_validation_loss_model=range(EPOCHS),
                ),
                step=lampdist.StepOptions(shuffle_seed=seed),
            )
    except lampdist.CheckpointError as exc:
        if not isinstance(exc.__cause__, Interrupt):
            raise
    return modules


def assert_equal_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


async def test_a_shuffled_run_is_exact_run_after_run() -> None:
    first = await train()
    for _ in range(2):
        again = await train()
        for a, b in zip(first, again, strict=True):
            assert_equal_weights(a, b)
    other_seed = await train(seed=1)
    weight = first[0].state_dict()["0.weight"]
    assert not torch.equal(weight, other_seed[0].state_dict()["0.weight"])


async def test_an_interrupted_shuffled_run_resumes_exactly(tmp_path: Path) -> None:
    uninterrupted = await train()
    await train(directory=tmp_path, interrupt_after=2)
    resumed = await anyio.to_thread.run_sync(checkpoint.load_latest, tmp_path)
    assert resumed is not None and resumed.epoch == 2
    # Other initial weights: only the checkpoint can make the resumed run end the same.
    finished = await train(directory=tmp_path, resume=resumed, model_seed=7)
    for a, b in zip(uninterrupted, finished, strict=True):
        assert_equal_weights(a, b)


async def test_each_pass_is_told_its_epoch_rank_and_seed() -> None:
    seen: list[lampdist.PassContext] = []

    def recording(shard: list[Batch]) -> lampdist.PassAwareBatchSource:
        def source(context: lampdist.PassContext) -> list[Batch]:
            seen.append(context)
            return shard

        return source

    await lampdist.local_data_parallel_training_loop(
        models_with_data_streams=[
            lampdist.ModelWithData(
                model=lampdist.SupervisedModel(make_model(), mse),
                train_batches=recording(shard),
                validation_batches=recording(valid),
            )
            for shard, valid in zip(TRAIN, VALID, strict=True)
        ],
        optimizer_factory=adamw,
        loop=lampdist.LoopOptions(max_epochs=2),
        step=lampdist.StepOptions(shuffle_seed=5),
    )
    coordinates = sorted((c.epoch, c.kind, c.rank) for c in seen)
    assert coordinates == [
        (epoch, kind, rank) for epoch in range(2) for kind in ("train", "valid") for rank in (0, 1)
    ]
    assert {c.nranks for c in seen} == {2}
    for context in seen:
        assert context.seed == pass_seed(5, context.rank, context.epoch, context.kind)
    assert len({c.seed for c in seen}) == len(seen)  # every rank and pass its own
    draw = [int(torch.randint(1 << 30, (1,), generator=c.generator())) for c in seen[:2]]
    assert draw == [int(torch.randint(1 << 30, (1,), generator=c.generator())) for c in seen[:2]]


def test_zero_argument_sources_and_defaults_are_called_bare() -> None:
    batches = TRAIN[0]
    entry = lampdist.ModelWithData(
        model=lampdist.SupervisedModel(make_model(), mse),
        train_batches=lambda shard=batches: shard,  # a default is no pass argument
        validation_batches=functools.partial(list, batches),
    )
    assert entry.train_batches() is batches  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (lambda context, other: [], r"requires \['context', 'other'\]"),
        (lambda *, context: [], r"requires \['context'\]"),
        ([], "train_batches must be a callable"),
    ],
)
def test_a_source_that_takes_other_arguments_is_refused(source: Any, message: str) -> None:
    with pytest.raises(lampdist.ConfigError, match=message):
        lampdist.ModelWithData(
            model=lampdist.SupervisedModel(make_model(), mse), train_batches=source
        )


def test_the_shuffle_seed_must_be_an_int() -> None:
    with pytest.raises(lampdist.ConfigError, match="shuffle_seed must be an int"):
        lampdist.StepOptions(shuffle_seed=1.5)  # type: ignore[arg-type]  # on purpose
