"""In-process cliques: the arithmetic of every collective for 1 to 3 ranks, and how they fail
(a silent rank, an abort, a cancelled rank, disagreeing ranks, a rank that left, bad devices)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
import pytest
import torch

import lampdist
from lampdist.clique import Clique, in_process

from .checks import check_collectives, check_started_collectives

T = TypeVar("T")


async def run_local(
    nranks: int,
    body: Callable[[Clique], Awaitable[T]],
    *,
    devices: Sequence[str] | None = None,
    collective_timeout: float | None = 20.0,
) -> list[T]:
    """Run ``body`` on every rank of a fresh in-process clique, one task per rank."""
    cliques = in_process(devices or ["cpu"] * nranks, collective_timeout=collective_timeout)
    results: dict[int, T] = {}

    async def one(rank: int) -> None:
        async with cliques.hub.open(rank) as clique:
            results[rank] = await body(clique)

    async with anyio.create_task_group() as group:
        for rank in range(nranks):
            group.start_soon(one, rank)
    return [results[rank] for rank in range(nranks)]


@pytest.mark.parametrize("nranks", [1, 2, 3])
async def test_every_collective_adds_and_copies_right(nranks: int) -> None:
    async def body(clique: Clique) -> str:
        await check_collectives(clique)
        await check_started_collectives(clique)
        return clique.backend

    with anyio.fail_after(30):
        assert await run_local(nranks, body) == ["local"] * nranks


async def test_collectives_from_plain_threads_wait_blocking() -> None:
    """The way ranks' compute threads use it: start and wait_blocking, no event loop."""

    async def body(clique: Clique) -> list[float]:
        def step() -> list[float]:
            tensor = torch.full((4,), float(clique.rank + 1))
            clique.start_all_reduce([tensor]).wait_blocking(None)
            clique.start_broadcast([tensor], root=1).wait_blocking(None)
            return tensor.tolist()

        return await anyio.to_thread.run_sync(step)

    with anyio.fail_after(30):
        assert await run_local(3, body) == [[6.0] * 4] * 3


async def test_a_silent_rank_times_out_naming_it() -> None:
    timed_out = anyio.Event()

    async def body(clique: Clique) -> str:
        if clique.rank == 1:
            await timed_out.wait()  # silent until rank 0 gave up
            return ""
        with pytest.raises(lampdist.CliqueTimeout) as caught:
            await clique.all_reduce([torch.ones(3)])
        timed_out.set()
        return str(caught.value)

    with anyio.fail_after(10):
        message, _ = await run_local(2, body, collective_timeout=0.5)
    assert "collective_timeout=0.5 s (rank(s) [1] did not start it)" in message


async def test_a_rank_that_fails_breaks_the_clique_for_the_others_at_once() -> None:
    waiting = anyio.Event()

    async def body(clique: Clique) -> None:
        if clique.rank == 1:
            await waiting.wait()
            raise RuntimeError("boom")
        pending = clique.start_all_reduce([torch.ones(3)])
        waiting.set()
        with pytest.raises(lampdist.CollectiveFailed, match="rank 1 left the clique: Runtime"):
            await pending
        with pytest.raises(lampdist.CollectiveFailed, match="rank 1 left the clique"):
            clique.start_broadcast([torch.ones(1)])

    with anyio.fail_after(10), pytest.raises(ExceptionGroup) as caught:
        await run_local(2, body, collective_timeout=None)
    assert caught.group_contains(RuntimeError, match="boom")


async def test_a_cancelled_rank_breaks_the_clique_naming_it() -> None:
    async def body(clique: Clique) -> None:
        if clique.rank == 1:
            with anyio.move_on_after(0.2):
                await anyio.sleep_forever()
            return
        with pytest.raises(lampdist.CollectiveFailed, match="rank 1 left the clique: cancelled"):
            await clique.all_reduce([torch.ones(3)])

    cliques = in_process(["cpu"] * 2, collective_timeout=None)

    async def one(rank: int) -> None:
        if rank == 1:
            with anyio.CancelScope() as scope:
                async with cliques.hub.open(rank):
                    scope.cancel()
                    await anyio.sleep_forever()
            return
        async with cliques.hub.open(rank) as clique:
            await body(clique)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(one, 0)
            group.start_soon(one, 1)


async def test_ranks_that_disagree_fail_on_every_rank() -> None:
    async def different_collectives(clique: Clique) -> None:
        expected = "rank 1 started reduce while rank 0 started broadcast"
        if clique.rank == 0:
            with pytest.raises(lampdist.CollectiveFailed, match=expected):
                await clique.broadcast([torch.ones(2)])
        else:
            await anyio.sleep(0.1)  # rank 0 has started its broadcast
            with pytest.raises(lampdist.CollectiveFailed, match=expected):
                await clique.reduce([torch.ones(2)])

    async def different_sizes(clique: Clique) -> None:
        with pytest.raises(lampdist.CollectiveFailed, match="alike tensors"):
            await clique.all_reduce([torch.ones(2 + clique.rank)])

    with anyio.fail_after(10):
        await run_local(2, different_collectives)
        await run_local(2, different_sizes)


async def test_a_rank_that_left_fails_the_others_at_once_and_its_clique_is_closed() -> None:
    cliques = in_process(["cpu"] * 2, collective_timeout=None)
    left = anyio.Event()
    kept: list[Clique] = []

    async def leaver() -> None:
        async with cliques.hub.open(1) as clique:
            kept.append(clique)
        left.set()

    async def stayer() -> None:
        async with cliques.hub.open(0) as clique:
            pending = clique.start_all_reduce([torch.ones(2)])
            with pytest.raises(lampdist.CollectiveFailed, match="rank 1 has left the clique"):
                await pending

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(stayer)
            await anyio.sleep(0.1)  # rank 0 waits in its all_reduce
            group.start_soon(leaver)
    with pytest.raises(lampdist.CliqueError, match="closed"):
        kept[0].start_all_reduce([torch.ones(1)])


@pytest.mark.parametrize(
    ("devices", "match"),
    [
        ([], "at least one rank"),
        (["cpu", "cuda:0"], "every rank on the CPU"),
        (["cuda:0", "cuda:0"], "a GPU of its own"),
        (["bad"], "'bad' is no device"),
        ([3.5], "3.5 is no device"),
    ],
)
def test_devices_that_cannot_share_a_clique_are_refused(devices: list[Any], match: str) -> None:
    with pytest.raises(lampdist.ConfigError, match=match):
        in_process(devices)
