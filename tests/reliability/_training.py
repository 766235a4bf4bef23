"""The training run of the reliability tests, in one process: the uninterrupted reference,
and resuming from a checkpoint directory to the end of the run."""

from __future__ import annotations

import functools
from pathlib import Path

import anyio
import torch

import lampdist
from lampdist import checkpoint

from ..roles.reference import make_model, mse
from . import rank as rank_script

EPOCHS = 3
"""Epochs of every run of the fault matrix; faults strike in epoch 1."""

_references: dict[tuple[int, int], dict[str, torch.Tensor]] = {}


def entries(nranks: int) -> list[lampdist.ModelWithData]:
    """The rank script's models and batches, for the in-process loop."""
    train, valid = rank_script.shards(nranks)
    return [
        lampdist.ModelWithData(
            model=lampdist.SupervisedModel(make_model(seed=0 if r == 0 else 10 + r), mse),
            train_batches=functools.partial(list, train[r]),
            validation_batches=functools.partial(list, valid[r]),
        )
        for r in range(nranks)
    ]


async def train_in_process(
    nranks: int,
    *,
    epochs: int = EPOCHS,
    resume_from: Path | None = None,
    checkpoints: Path | None = None,
) -> dict[str, torch.Tensor]:
    """Train in one process (from ``resume_from``'s latest checkpoint, if given) to ``epochs``
    and return the final weights."""
    streams = entries(nranks)
    resumed = checkpoint.load_latest(resume_from) if resume_from is not None else None
    with anyio.fail_after(60):
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=streams,
            optimizer_factory=rank_script.sgd,
            resume=resumed,
            loop=lampdist.LoopOptions(
                max_epochs=epochs,
                checkpoint_state=checkpoint.to_directory(checkpoints) if checkpoints else None,
            ),
        )
    return {name: value.clone() for name, value in streams[0].model.module.state_dict().items()}


async def reference(nranks: int, epochs: int = EPOCHS) -> dict[str, torch.Tensor]:
    """The weights of the uninterrupted run (computed once per process)."""
    key = (nranks, epochs)
    if key not in _references:
        _references[key] = await train_in_process(nranks, epochs=epochs)
    return _references[key]


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-9, msg=name)


def latest_epoch(directory: Path) -> int | None:
    """The ``loop_state.epoch`` of the newest intact checkpoint (the next epoch to run)."""
    loaded = checkpoint.load_latest(directory)
    return None if loaded is None else loaded.epoch
