"""A checkpoint resumed on another number of ranks: the warning that every rank starts its
training data afresh comes only when the checkpoint held places in the data to drop."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable

import anyio
import pytest
import torch

import lampdist

from .reference import make_model, make_shards, mse

AFRESH = "starts its training data afresh"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _sgd(parameters: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.1)


async def _train(
    nranks: int, step: lampdist.StepOptions, resume: lampdist.Resumed | None = None
) -> lampdist.TrainingState:
    """Train ``nranks`` ranks for one more epoch; the last checkpoint's state."""
    shards = make_shards([[4, 4, 4]] * nranks, seed=3)
    saved: list[lampdist.TrainingState] = []

    async def checkpoint(state: lampdist.TrainingState, lr_state: object) -> None:
        saved.append(copy.deepcopy(state))

    with anyio.fail_after(60):
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(make_model(seed=rank), mse),
                    train_batches=lambda s=shard: list(s),
                )
                for rank, shard in enumerate(shards)
            ],
            optimizer_factory=_sgd,
            loop=lampdist.LoopOptions(
                max_epochs=1 if resume is None else resume.epoch + 1, checkpoint_state=checkpoint
            ),
            step=step,
            resume=resume,
        )
    return saved[-1]


@pytest.mark.parametrize(
    ("steps_per_epoch", "warns"), [(None, False), (2, True)], ids=["passes", "windows"]
)
async def test_a_resume_on_fewer_ranks_warns_only_of_places_it_drops(
    caplog: pytest.LogCaptureFixture, steps_per_epoch: int | None, warns: bool
) -> None:
    step = lampdist.StepOptions(steps_per_epoch=steps_per_epoch)
    state = await _train(2, step)
    assert state.rank_states is not None and len(state.rank_states) == 2
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lampdist"):
        await _train(1, step, resume=lampdist.Resumed(training_state=state))
    warnings = [record for record in caplog.records if AFRESH in record.getMessage()]
    assert len(warnings) == int(warns), [record.getMessage() for record in caplog.records]
