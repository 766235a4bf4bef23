"""Two CPU ranks interrupted after epoch k and resumed from their checkpoint directory end
bitwise equal to an uninterrupted run."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

import lampdist
from lampdist import checkpoint, schedules

from .reference import make_model, make_shards, mse


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def adamw(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05)


class Interrupt(Exception):
    pass


async def run(
    directory: Path,
    schedule: schedules.LearningRateSchedule[Any],
    *,
    interrupt_after: int | None = None,
    resume: bool = False,
) -> list[torch.nn.Module]:
    shards = make_shards([[6, 5, 7], [4, 8]], seed=21)
    valid = make_shards([[6], [5]], seed=22)
    modules = [make_model(), make_model(seed=3)]
    write = checkpoint.to_directory(directory, keep=2)

    async def checkpoint_then_maybe_stop(state: lampdist.TrainingState, lr_state: Any) -> None:
        await write(state, lr_state)
        if interrupt_after is not None and state.loop_state.epoch == interrupt_after:
            raise Interrupt

    loaded = checkpoint.load_latest(directory) if resume else None
    try:
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(m, mse),
                    train_batches=functools.partial(list, s),
                    validation_batches=functools.partial(list, v),
                )
                for m, s, v in zip(modules, shards, valid, strict=True)
            ],
            optimizer_factory=adamw,
            resume=loaded,
            loop=lampdist.LoopOptions(
                max_epochs=6,
                checkpoint_state=checkpoint_then_maybe_stop,
                learning_rate_schedule=schedule,
                return_min_validation_loss_model=range(6),
            ),
        )
    except lampdist.CheckpointError as exc:
        if not isinstance(exc.__cause__, Interrupt):
            raise
    return modules


@pytest.mark.parametrize(
    "schedule",
    [
        schedules.reduce_on_plateau(patience=1, reduce_factor=0.5),
        schedules.from_epoch_count(lambda epoch: 1.0 if epoch < 2 else 60.0),  # best model early
    ],
    ids=["reduce_on_plateau", "best-model"],
)
async def test_resumed_from_disk_equals_uninterrupted(
    tmp_path: Path, schedule: schedules.LearningRateSchedule[Any]
) -> None:
    whole = await run(tmp_path / "whole", schedule)
    await run(tmp_path / "split", schedule, interrupt_after=3)
    latest = checkpoint.load_latest(tmp_path / "split")
    assert latest is not None
    assert latest.epoch == 3
    resumed = await run(tmp_path / "split", schedule, resume=True)
    for a, b in zip(whole, resumed, strict=True):
        for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
            assert torch.equal(x, y), name
    final_whole = checkpoint.load_latest(tmp_path / "whole")
    final_split = checkpoint.load_latest(tmp_path / "split")
    assert final_whole is not None
    assert final_split is not None
    assert final_split.training_state.loop_state == final_whole.training_state.loop_state
    assert final_split.schedule_state == final_whole.schedule_state
