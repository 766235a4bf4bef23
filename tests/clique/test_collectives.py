"""Every collective against the arithmetic, with ranks as tasks of one process (Gloo)."""

from __future__ import annotations

import threading

import anyio
import anyio.to_thread
import pytest
import torch

import lampdist
from lampdist.clique import Clique, PendingCollective, serve_rendezvous
from lampdist.clique._gather import GatherReduce
from lampdist.clique._transport import GroupTransport

from ._helpers import open_rank, run_ranks, total, values
from .checks import check_collectives, check_started_collectives


@pytest.fixture
def anyio_backend() -> str:
    """Most clique tests run on asyncio only; the bridge has its own trio tests below."""
    return "asyncio"


@pytest.mark.parametrize("nranks", [2, 3, 4])
async def test_collectives_match_the_arithmetic(nranks: int) -> None:
    with anyio.fail_after(30):
        await run_ranks(nranks, check_collectives)


@pytest.mark.parametrize("nranks", [2, 3])
async def test_started_collectives_match_the_arithmetic(nranks: int) -> None:
    with anyio.fail_after(30):
        await run_ranks(nranks, check_started_collectives)


@pytest.mark.parametrize("root", [0, 2])
async def test_gloo_reduce_small_and_large_many_times(root: int) -> None:
    # Gloo reduces tensors up to 4 MiB as a gather and a sum on the root, which keeps its
    # gather buffers for the next reduce of that size; larger ones take Gloo's own reduce.
    # Same-size reduces in flight together must not share buffers.
    small, large = 1000, (4 << 20) // 4 + 1  # float32 elements: 4 KB and just over 4 MiB

    async def body(clique: Clique) -> GatherReduce | None:
        rank = clique.rank
        for _ in range(3):
            tensors = [values(rank, small, torch.float32, "cpu") for _ in range(3)]
            tensors.append(values(rank, large, torch.float32, "cpu"))
            started = [clique.start_reduce([tensor], root=root) for tensor in tensors]
            for pending in started:
                await pending
            if rank == root:
                for tensor in tensors:
                    assert torch.equal(tensor, total(3, tensor.numel(), torch.float32))
                assert gather_reduce(clique) is not None
                assert gather_reduce(clique)._spare  # type: ignore[union-attr]
        return gather_reduce(clique)

    with anyio.fail_after(60):
        gathers = await run_ranks(3, body)
    assert all(g is not None and not g._spare for g in gathers)  # dropped when it closed


def gather_reduce(clique: Clique) -> GatherReduce | None:
    transport = clique._transport
    assert isinstance(transport, GroupTransport)
    return transport.gather_reduce


async def test_enqueue_thread_path_matches_the_arithmetic() -> None:
    # NCCL always enqueues from a thread of its own; here Gloo takes that path too.
    async def both(clique: Clique) -> None:
        await check_collectives(clique)
        await check_started_collectives(clique)

    with anyio.fail_after(30):
        await run_ranks(2, both, threaded=True)


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_bridge_on_trio() -> None:
    with anyio.fail_after(30):
        await run_ranks(3, check_started_collectives)
        await run_ranks(2, check_collectives, threaded=True)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_awaiting_leaves_the_event_loop_running() -> None:
    # Rank 1 joins only after a ticker on the same loop has ticked while rank 0 waits: if the
    # wait parked the loop, rank 1 would never join and the deadline would fail the test.
    ticked = anyio.Event()
    waiting = anyio.Event()

    async def ticker() -> None:
        await waiting.wait()
        for _ in range(5):
            await anyio.sleep(0.001)
        ticked.set()

    async def body(clique: Clique) -> float:
        tensor = torch.full((3,), float(clique.rank + 1))
        if clique.rank == 0:
            pending = clique.start_all_reduce([tensor])
            waiting.set()
            await pending
        else:
            await ticked.wait()
            await clique.all_reduce([tensor])
        return float(tensor[0])

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            assert await run_ranks(2, body) == [3.0, 3.0]


async def test_wait_blocking_refuses_the_event_loop_thread() -> None:
    async def body(clique: Clique) -> None:
        pending = clique.start_all_reduce([torch.ones(2)])
        if clique.rank == 0:
            with pytest.raises(lampdist.ConfigError, match="await"):
                pending.wait_blocking(1.0)
        await pending

    with anyio.fail_after(20):
        await run_ranks(2, body)


async def test_wait_blocking_own_timeout_raises_clique_timeout() -> None:
    gate = threading.Event()

    async def body(clique: Clique) -> None:
        tensor = torch.ones(2)
        if clique.rank == 0:
            pending = clique.start_all_reduce([tensor])
            with pytest.raises(lampdist.CliqueTimeout, match="wait_blocking"):
                await anyio.to_thread.run_sync(pending.wait_blocking, 0.05)
            gate.set()
            await pending  # the collective itself is fine
        else:
            await anyio.to_thread.run_sync(gate.wait)
            await clique.all_reduce([tensor])
        assert tensor.tolist() == [2.0, 2.0]

    with anyio.fail_after(20):
        await run_ranks(2, body)


async def test_bad_arguments_raise_config_error() -> None:
    async def body(clique: Clique) -> None:
        with pytest.raises(lampdist.ConfigError, match="sequence"):
            clique.start_all_reduce(torch.ones(2))  # type: ignore[arg-type]
        with pytest.raises(lampdist.ConfigError, match="contiguous"):
            await clique.all_reduce([torch.ones(4, 4).t()])
        with pytest.raises(lampdist.ConfigError, match="device"):
            await clique.broadcast([torch.ones(2, device="meta")])
        with pytest.raises(lampdist.ConfigError, match="root"):
            await clique.reduce([torch.ones(2)], root=clique.nranks)
        with pytest.raises(lampdist.ConfigError, match="nranks"):
            await clique.reduce_scatter(torch.ones(2), torch.ones(3))
        with pytest.raises(lampdist.ConfigError, match="nranks"):
            await clique.all_gather(torch.ones(3), torch.ones(2))
        with pytest.raises(lampdist.ConfigError) as caught:
            await clique.all_gather(torch.ones(4), torch.ones(2, dtype=torch.int64))
        assert (caught.value.rank, caught.value.phase) == (clique.rank, "all_gather")
        # None of that broke the clique.
        tensor = values(clique.rank, 3, torch.float32, "cpu")
        await clique.all_reduce([tensor])

    with anyio.fail_after(20):
        await run_ranks(2, body)


async def test_several_cliques_in_one_process_at_once() -> None:
    async def rank(
        clique_a: lampdist.clique.CliqueId,
        clique_b: lampdist.clique.CliqueId,
        index: int,
        out: dict[int, list[float]],
    ) -> None:
        async with open_rank(clique_a, index, "cpu") as a, open_rank(clique_b, index, "cpu") as b:
            x, y = torch.full((2,), float(index + 1)), torch.full((2,), float(10 * (index + 1)))
            first: PendingCollective = a.start_all_reduce([x])
            await b.all_reduce([y])
            await first
            await b.broadcast([x], root=1)
            out[index] = [x[0].item(), y[0].item()]

    out: dict[int, list[float]] = {}
    with anyio.fail_after(30):
        async with serve_rendezvous(nranks=2) as id_a, serve_rendezvous(nranks=2) as id_b:
            assert id_a.prefix != id_b.prefix
            async with anyio.create_task_group() as tg:
                for index in range(2):
                    tg.start_soon(rank, id_a, id_b, index, out)
    assert out == {0: [3.0, 30.0], 1: [3.0, 30.0]}


async def test_one_clique_id_opens_again() -> None:
    async def body(clique: Clique) -> float:
        tensor = torch.ones(1)
        await clique.all_reduce([tensor])
        return float(tensor[0])

    async def rank(clique_id: lampdist.clique.CliqueId, index: int, out: list[float]) -> None:
        for _ in range(2):
            async with open_rank(clique_id, index, "cpu") as clique:
                out.append(await body(clique))

    out: list[float] = []
    with anyio.fail_after(30):
        async with serve_rendezvous(nranks=2) as clique_id, anyio.create_task_group() as tg:
            for index in range(2):
                tg.start_soon(rank, clique_id, index, out)
    assert out == [2.0] * 4


async def test_a_limiter_with_one_token_per_rank_suffices() -> None:
    limiter = anyio.CapacityLimiter(3)
    with anyio.fail_after(30):
        await run_ranks(3, check_collectives, limiter=limiter)
