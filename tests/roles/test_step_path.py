"""The step path: passes run on the ranks' compute threads without the event loop, and a
cancelled pass stops between steps and leaves no thread behind."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch

import lampdist

from .reference import make_model, make_shards, mse


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


def lampdist_threads() -> list[str]:
    prefixes = ("lampdist-compute-", "lampdist-load-")
    return [t.name for t in threading.enumerate() if t.name.startswith(prefixes)]


async def test_training_goes_on_while_on_event_blocks_the_event_loop() -> None:
    """on_event blocks the event loop's thread from the first step's event until the root has
    started its last batch's forward: through the loop, the steps would wait for it until
    the timeout."""
    steps = 30
    shards = make_shards([[4] * steps, [4] * steps], seed=3)
    modules = [make_model(), make_model(seed=1)]
    last_forward = threading.Event()
    forwards = 0

    def count(module: torch.nn.Module, inputs: Any) -> None:
        nonlocal forwards
        forwards += 1
        if forwards == steps:
            last_forward.set()

    modules[0].register_forward_pre_hook(count)
    blocked: list[bool] = []

    async def on_event(event: lampdist.PassEvent) -> None:
        if not blocked:
            # Blocks the event loop on purpose while the ranks go on training.
            blocked.append(last_forward.wait(30))

    with anyio.fail_after(60):
        state = await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(module, mse),
                    train_batches=lambda s=shard: s,
                    validation_batches=None,
                )
                for module, shard in zip(modules, shards, strict=True)
            ],
            optimizer_factory=sgd,
            loop=lampdist.LoopOptions(max_epochs=1, on_event=on_event),
        )
    assert blocked == [True], "the steps waited for the blocked event loop"
    assert state.epoch == 1


async def test_cancelling_a_pass_stops_it_between_steps_and_ends_its_threads() -> None:
    total = 1000
    taken = 0
    started = threading.Event()

    def slow_batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        nonlocal taken
        for x, y in make_shards([[2] * total], seed=5)[0]:
            taken += 1
            yield x, y

    def slow_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        started.set()
        threading.Event().wait(0.01)  # a step of 10 ms
        return mse(output, target)

    async def train() -> None:
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(make_model(), slow_loss),
                    train_batches=slow_batches,
                    validation_batches=None,
                )
            ],
            optimizer_factory=sgd,
            loop=lampdist.LoopOptions(max_epochs=1),
        )

    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(train)
            await anyio.to_thread.run_sync(started.wait, 30)
            await anyio.sleep(0.2)
            group.cancel_scope.cancel()
        while lampdist_threads():  # noqa: ASYNC110  # a thread's end has no event to await
            await anyio.sleep(0.01)
    assert taken < total  # stopped between steps, not at the end of the pass
