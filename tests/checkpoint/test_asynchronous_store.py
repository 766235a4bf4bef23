"""Asynchronous checkpoints into a real S3 endpoint (moto's server) through a training run:
committed at the end, and a store that stops answering ends the run naming the object while
the checkpoints committed before stay loadable."""

from __future__ import annotations

import functools
import secrets
from collections.abc import Iterable
from typing import Any

import pytest
import torch

import lampdist
from lampdist import checkpoint
from lampdist._checkpoint import list_checkpoints

from ..roles.reference import make_model, make_shards, mse
from .s3_server import S3Server
from .test_checkpoint import assert_identical


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def adamw(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05)


async def _train(effect: Any, *, epochs: int, on_event: Any = None) -> list[torch.nn.Module]:
    shards = make_shards([[6, 5, 7], [4, 8]], seed=21)
    modules = [make_model(), make_model(seed=3)]
    await lampdist.local_data_parallel_training_loop(
        models_with_data_streams=[
            lampdist.ModelWithData(
                model=lampdist.SupervisedModel(m, mse), train_batches=functools.partial(list, s)
            )
            for m, s in zip(modules, shards, strict=True)
        ],
        optimizer_factory=adamw,
        loop=lampdist.LoopOptions(max_epochs=epochs, checkpoint_state=effect, on_event=on_event),
    )
    return modules


async def test_asynchronous_checkpoints_to_s3_are_committed_by_the_end_of_the_run(
    s3_url: str,
) -> None:
    modules = await _train(checkpoint.to_url(s3_url, keep=2, asynchronous=True), epochs=4)
    loaded = checkpoint.load_latest(s3_url)
    assert loaded is not None and loaded.epoch == 4 and loaded.path == f"{s3_url}/epoch-000004"
    assert_identical(dict(loaded.training_state.model_state), dict(modules[0].state_dict()))
    listed = list_checkpoints(s3_url, verify=True)
    assert [(item.name, item.verified) for item in listed] == [
        ("epoch-000004", True),
        ("epoch-000003", True),
    ]


async def test_a_store_that_stops_answering_ends_the_run_and_keeps_what_was_committed(
    own_s3_server: S3Server,
) -> None:
    url = f"s3://{own_s3_server.create_bucket()}/run-{secrets.token_hex(3)}"
    options = {"timeout": "1s", "connect_timeout": "1s", "max_retries": "1", "retry_timeout": "2"}
    effect = checkpoint.to_url(url, keep=5, asynchronous=True, options=options)

    async def pause_at_epoch_2(event: lampdist.PassEvent) -> None:
        if event.epoch == 2:
            own_s3_server.pause()  # epoch 0's checkpoint is committed, epoch 1's may be writing

    try:
        with pytest.raises(lampdist.CheckpointError) as caught:
            await _train(effect, epochs=8, on_event=pause_at_epoch_2)
    finally:
        own_s3_server.resume()
    assert caught.value.phase == "checkpoint" and caught.value.rank == 0
    message = str(caught.value)
    assert "the asynchronous checkpoint of epoch" in message and "could not" in message
    assert url in message
    loaded = checkpoint.load_latest(url)
    assert loaded is not None and loaded.epoch in (1, 2)  # the committed ones, verified


async def test_a_store_that_stops_answering_a_synchronous_checkpoint_names_the_rank(
    own_s3_server: S3Server,
) -> None:
    """A synchronous write that the store stops answering ends the run with a
    CheckpointError naming rank 0 and the phase, as the asynchronous one does."""
    url = f"s3://{own_s3_server.create_bucket()}/run-{secrets.token_hex(3)}"
    options = {"timeout": "1s", "connect_timeout": "1s", "max_retries": "1", "retry_timeout": "2"}
    effect = checkpoint.to_url(url, keep=5, options=options)

    async def pause_at_epoch_2(event: lampdist.PassEvent) -> None:
        if event.epoch == 2:
            own_s3_server.pause()

    try:
        with pytest.raises(lampdist.CheckpointError) as caught:
            await _train(effect, epochs=8, on_event=pause_at_epoch_2)
    finally:
        own_s3_server.resume()
    assert caught.value.rank == 0 and caught.value.phase == "checkpoint"
    assert str(caught.value).startswith("rank 0, phase 'checkpoint': ")
