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


RESUMED_SEED = 1000
"""The resumed runs build their models from other seeds: only the checkpoint can make them end
where the uninterrupted run ends."""


def entries(nranks: int, *, seed: int = 0) -> list[lampdist.ModelWithData]:
    """The rank script's models (the root's from ``seed``) and batches, for the in-process
    loop."""
    train, valid = rank_script.shards(nranks)
    return [
        lampdist.ModelWithData(
            model=lampdist.SupervisedModel(make_model(seed=seed if r == 0 else 10 + r), mse),
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
    and return the final weights.

    A resumed run starts from other initial weights (:data:`RESUMED_SEED`) and must train
    exactly the epochs from the checkpoint's on.
    """
    resumed = checkpoint.load_latest(resume_from) if resume_from is not None else None
    streams = entries(nranks, seed=RESUMED_SEED if resumed is not None else 0)
    trained: list[int] = []

    async def record(event: lampdist.PassEvent) -> None:
        if event.kind == "train" and event.done:
            trained.append(event.epoch)

    with anyio.fail_after(60):
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=streams,
            optimizer_factory=rank_script.sgd,
            resume=resumed,
            loop=lampdist.LoopOptions(
                max_epochs=epochs,
                checkpoint_state=checkpoint.to_directory(checkpoints) if checkpoints else None,
                on_event=record,
            ),
        )
    first = resumed.epoch if resumed is not None else 0
    assert trained == list(range(first, epochs)), (first, trained)
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
        assert torch.equal(got[name], value), name


def latest_epoch(directory: Path) -> int | None:
    """The ``loop_state.epoch`` of the newest intact checkpoint (the next epoch to run)."""
    loaded = checkpoint.load_latest(directory)
    return None if loaded is None else loaded.epoch
