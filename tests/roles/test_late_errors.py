"""Mistakes that cost nothing to find are reported before training, not after an epoch: a
checkpoint directory that another run holds, a resume with no epoch left to train."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterable
from pathlib import Path

import anyio
import pytest
import torch

import lampdist
from lampdist import checkpoint

from .reference import make_model, make_shards, mse


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


async def run(
    directory: Path, *, max_epochs: int, resume: lampdist.Resumed | None = None
) -> tuple[lampdist.LoopState, list[int]]:
    """Two ranks in one process, checkpointing into ``directory``; and the batches trained."""
    trained: list[int] = []

    def counted(
        shard: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        for batch in shard:
            trained.append(1)
            yield batch

    shards = make_shards([[4, 4], [4, 4]], seed=5)
    with anyio.fail_after(30):
        state = await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(make_model(), mse),
                    train_batches=functools.partial(counted, shard),
                )
                for shard in shards
            ],
            optimizer_factory=sgd,
            resume=resume,
            loop=lampdist.LoopOptions(
                max_epochs=max_epochs, checkpoint_state=checkpoint.to_directory(directory)
            ),
        )
    return state, trained


async def test_a_new_run_into_a_directory_of_checkpoints_is_refused_before_training(
    tmp_path: Path,
) -> None:
    await run(tmp_path, max_epochs=2)
    with pytest.raises(lampdist.CheckpointError) as caught:
        await run(tmp_path, max_epochs=2)
    error = caught.value
    assert (error.rank, error.phase) == (0, "configure")
    assert "already holds checkpoints (the newest of epoch 2) and this is a new run" in str(error)
    assert "pass resume=load_latest(directory)" in str(error)
    # Nothing was trained and nothing was written by the refused run.
    written = sorted(name for name in os.listdir(tmp_path) if name.startswith("epoch"))
    assert written == ["epoch-000001", "epoch-000002"]


async def test_a_resumed_run_behind_the_directory_is_refused_before_training(
    tmp_path: Path,
) -> None:
    await run(tmp_path, max_epochs=4)
    older = checkpoint.load_latest(tmp_path)
    assert older is not None
    await run(tmp_path / "other", max_epochs=1)
    early = checkpoint.load_latest(tmp_path / "other")  # epoch 1; tmp_path holds up to 4
    assert early is not None and early.epoch == 1
    with pytest.raises(lampdist.CheckpointError, match="newer than the run resumed at epoch 1"):
        await run(tmp_path, max_epochs=4, resume=early)


async def test_resuming_the_newest_checkpoint_is_no_reuse(tmp_path: Path) -> None:
    await run(tmp_path, max_epochs=2)
    resumed = checkpoint.load_latest(tmp_path)
    state, trained = await run(tmp_path, max_epochs=3, resume=resumed)
    assert state.epoch == 3
    assert len(trained) == 4  # one epoch: two batches on each of two ranks


async def test_resuming_with_no_epoch_left_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await run(tmp_path, max_epochs=2)
    resumed = checkpoint.load_latest(tmp_path)
    caplog.set_level(logging.WARNING, logger="lampdist")
    state, trained = await run(tmp_path, max_epochs=2, resume=resumed)
    assert (state.epoch, trained) == (2, [])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "rank 0: the run resumes at epoch 2 and max_epochs=2: no epoch is left to train; "
        "raise max_epochs to train on"
    ]
