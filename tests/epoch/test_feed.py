"""Batch feeds: the loading thread hands batches straight to the compute thread, a few ahead;
order, bounded read-ahead, early stops, slow sources, errors, async sources, one intra-op
thread on the loading thread, and no event loop on the path."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
import torch

import lampdist
from lampdist import PassContext, SupervisedModel
from lampdist._epoch import BatchFeed, PassStopped, open_compute_thread, open_feed


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


def feed_of(
    source: Any, *, rank: int = 0, phase: Literal["train", "valid"] = "train", ahead: int = 2
) -> Any:
    context = PassContext(epoch=0, kind=phase, rank=rank, nranks=1, seed=0)
    return open_feed(
        source,
        context,
        model=MODEL,
        device=CPU,
        rank=rank,
        phase=phase,
        intra_op_threads=torch.get_num_threads(),
        ahead=ahead,
    )


def read_all(feed: BatchFeed) -> list[tuple[int, int]]:
    """On the compute thread: every batch's first value and example count."""
    seen = []
    while (loaded := feed.next()) is not None:
        seen.append((int(loaded.data[0][0, 0]), loaded.examples))
    return seen


def loading_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("lampdist-load-")]


async def test_every_batch_arrives_in_order_with_its_example_count() -> None:
    source = Counted(50)
    async with open_compute_thread(0) as compute, feed_of(lambda: source) as feed:
        assert feed.total == 50
        seen = await compute.run(read_all, feed)
    assert seen == [(index, index + 1) for index in range(50)]
    assert feed.batches_read == 50


async def test_a_peek_at_the_next_weighted_batch_takes_nothing() -> None:
    """What a rank without a batch so far pads with: the first batch ahead that is not
    empty, past more batches than the feed loads ahead; every batch still comes in order."""
    sizes = [0, 0, 0, 3, 0, 1]

    def source() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for size in sizes:
            yield torch.zeros(size, 2), torch.zeros(size, dtype=torch.int64)

    def peek_then_read(feed: BatchFeed) -> tuple[int | None, list[int], bool]:
        peeked = feed.peek_weighted()
        first = None if peeked is None else peeked.examples
        assert feed.batches_read == 0
        seen = [loaded.examples for loaded in iter(feed.next, None)]
        return first, seen, feed.peek_weighted() is None

    async with open_compute_thread(0) as compute, feed_of(source, ahead=2) as feed:
        first, seen, last = await compute.run(peek_then_read, feed)
    assert (first, seen, last) == (3, sizes, True)
    assert feed.batches_read == len(sizes)


async def test_read_ahead_is_bounded_and_an_early_stop_ends_the_loading_thread() -> None:
    source = Counted(1000)
    async with open_compute_thread(0) as compute, feed_of(lambda: source, ahead=2) as feed:
        assert await compute.run(feed.next) is not None
        await anyio.sleep(0.2)  # time to read ahead as far as it may
        # one taken, two waiting in the feed, one loaded that waits for room at most
        assert 1 <= source.taken <= 4
    taken = source.taken
    with anyio.fail_after(5):
        while loading_threads():  # noqa: ASYNC110  # a thread's end has no event to await
            await anyio.sleep(0.01)
    assert source.taken == taken  # nothing read after the feed closed


async def test_cancelling_does_not_wait_for_a_slow_source() -> None:
    release = threading.Event()

    def slow() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield batch(0)
        release.wait(10)  # a DataLoader stuck on its workers
        yield batch(1)

    started = time.monotonic()
    async with open_compute_thread(0) as compute:
        with anyio.move_on_after(0.3) as scope:
            async with feed_of(slow) as feed:
                assert await compute.run(feed.next) is not None
                await compute.run(feed.next, on_cancel=feed.stop)
    release.set()
    assert scope.cancelled_caught
    assert time.monotonic() - started < 5.0


async def test_a_stopped_feed_stops_its_consumer() -> None:
    def endless() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield batch(0)

    async with open_compute_thread(0) as compute, feed_of(endless) as feed:
        feed.stop()
        with pytest.raises(PassStopped):
            await compute.run(read_all, feed)


@pytest.mark.parametrize("where", ["next", "shape"])
async def test_errors_name_the_rank_and_phase(where: str) -> None:
    def failing() -> Iterator[Any]:  # yields a non-batch on purpose
        yield batch(0)
        if where == "next":
            raise OSError("disk gone")
        yield "not a batch"

    expected = lampdist.TrainingError if where == "next" else lampdist.BadBatch
    async with open_compute_thread(3) as compute, feed_of(failing, rank=3, phase="valid") as feed:
        with pytest.raises(expected) as caught:
            await compute.run(read_all, feed)
    assert (caught.value.rank, caught.value.phase) == (3, "valid")
    assert feed.batches_read == 1  # the batch before the error arrived


async def test_an_async_iterable_is_read_on_the_loop() -> None:
    async def batches() -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
        for index in range(5):
            await anyio.lowlevel.checkpoint()
            yield batch(index)

    async with open_compute_thread(0) as compute, feed_of(batches, ahead=1) as feed:
        assert feed.total is None
        seen = await compute.run(read_all, feed)
    assert [examples for _, examples in seen] == [1, 2, 3, 4, 5]


async def test_batches_reach_the_compute_thread_while_the_event_loop_is_blocked() -> None:
    """The event loop is not on the batch path: with the loop thread blocked, the compute
    thread still reads every batch (through the loop, this would wait until the timeout)."""
    started, done = threading.Event(), threading.Event()
    seen: list[tuple[int, int]] = []

    def consume(feed: BatchFeed) -> None:
        started.set()
        seen.extend(read_all(feed))
        done.set()

    async with (
        open_compute_thread(0) as compute,
        feed_of(lambda: Counted(20)) as feed,
        anyio.create_task_group() as group,
    ):
        group.start_soon(compute.run, consume, feed)
        await anyio.to_thread.run_sync(started.wait, 10)  # the job runs
        # Blocks the event loop on purpose until the compute thread has every batch.
        assert done.wait(10), "the batches waited for the blocked event loop"
    assert len(seen) == 20


async def test_the_loading_thread_uses_one_intra_op_thread_and_restores_the_default() -> None:
    original = torch.get_num_threads()
    torch.set_num_threads(2)
    seen: list[int] = []

    def source() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        seen.append(torch.get_num_threads())  # on the loading thread
        yield batch(0)

    def fresh_thread_count() -> int:
        counts: list[int] = []
        thread = threading.Thread(target=lambda: counts.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        return counts[0]

    try:
        async with open_compute_thread(0) as compute:
            async with feed_of(source) as feed:
                await compute.run(read_all, feed)
            assert await compute.run(torch.get_num_threads) == 2
        assert seen == [1]
        assert fresh_thread_count() == 2  # the process-wide default is back
    finally:
        torch.set_num_threads(original)
