"""Batch sources read ahead on one loading thread: order, bounded read-ahead, early stops,
slow sources, errors, and async iterables."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

import lampdist
from lampdist.epoch import SupervisedModel, open_batches


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


MODEL = SupervisedModel(torch.nn.Linear(2, 2), torch.nn.functional.cross_entropy)
CPU = torch.device("cpu")


def batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((index + 1, 2), float(index)), torch.zeros(index + 1, dtype=torch.int64)


class Counted:
    """A sized source that counts how many batches were taken from it."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.taken = 0

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for index in range(self.count):
            self.taken += 1
            yield batch(index)


async def test_every_batch_arrives_in_order_with_its_example_count() -> None:
    source = Counted(50)
    async with open_batches(lambda: source, model=MODEL, device=CPU, rank=0, phase="train") as r:
        assert r.total == 50
        seen = []
        while (loaded := await r.next()) is not None:
            seen.append((int(loaded.inputs[0, 0]), loaded.examples))
    assert seen == [(index, index + 1) for index in range(50)]
    assert r.batches_read == 50


async def test_read_ahead_is_bounded_and_an_early_stop_ends_the_loading_thread() -> None:
    source = Counted(1000)
    threads = threading.active_count()
    async with open_batches(
        lambda: source, model=MODEL, device=CPU, rank=0, phase="train", prefetch=2
    ) as reader:
        assert await reader.next() is not None
        await anyio.sleep(0.2)  # time to read ahead as far as it may
        # one taken, one peeked by has_next at most, two in flight
        assert 1 <= source.taken <= 4
    taken = source.taken
    await anyio.sleep(0.2)
    assert source.taken == taken  # nothing read after the reader closed
    assert threading.active_count() <= threads + 2  # anyio keeps idle workers for a while


async def test_cancelling_does_not_wait_for_a_slow_source() -> None:
    release = threading.Event()

    def slow() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield batch(0)
        release.wait(10)  # a DataLoader stuck on its workers
        yield batch(1)

    started = time.monotonic()
    with anyio.move_on_after(0.3) as scope:
        async with open_batches(slow, model=MODEL, device=CPU, rank=0, phase="train") as reader:
            assert await reader.next() is not None
            await reader.next()
    release.set()
    assert scope.cancelled_caught
    assert time.monotonic() - started < 5.0


@pytest.mark.parametrize("where", ["next", "shape"])
async def test_errors_name_the_rank_and_phase(where: str) -> None:
    def failing() -> Iterator[Any]:  # yields a non-batch on purpose
        yield batch(0)
        if where == "next":
            raise OSError("disk gone")
        yield "not a batch"

    async def read_all() -> None:
        async with open_batches(failing, model=MODEL, device=CPU, rank=3, phase="valid") as r:
            while await r.next() is not None:
                pass

    expected = lampdist.TrainingError if where == "next" else lampdist.BadBatch
    with pytest.raises(ExceptionGroup) as caught:  # the pass's (the roles unwrap one error)
        await read_all()
    (error,) = caught.value.exceptions
    assert isinstance(error, expected)
    assert (error.rank, error.phase) == (3, "valid")


async def test_an_async_iterable_is_read_on_the_loop() -> None:
    async def batches() -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
        for index in range(5):
            await anyio.lowlevel.checkpoint()
            yield batch(index)

    async with open_batches(batches, model=MODEL, device=CPU, rank=0, phase="train") as reader:
        assert reader.total is None
        counts = []
        while (loaded := await reader.next()) is not None:
            counts.append(loaded.examples)
    assert counts == [1, 2, 3, 4, 5]
