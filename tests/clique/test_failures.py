"""Failure, cancellation and teardown: every rank raises promptly, nothing is left behind."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import pytest
import torch

import lampdist
from lampdist.clique import Clique, CliqueId, open_clique, serve_rendezvous
from lampdist.clique._transport import GroupTransport

from ._helpers import live_threads, open_fds, open_rank, run_ranks


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_nranks_mismatch_raises_at_once() -> None:
    clique_id = CliqueId.new("127.0.0.1", 1, nranks=2)  # nothing listens there
    with pytest.raises(lampdist.MismatchError) as caught:
        open_clique(nranks=3, rank=1, device="cpu", clique_id=clique_id)
    assert (caught.value.rank, caught.value.phase) == (1, "clique setup")
    assert "nranks" in str(caught.value)


@pytest.mark.parametrize(
    ("rank", "device", "setup_timeout", "match"),
    [
        (2, "cpu", 1.0, "rank"),
        (0, "meta", 1.0, "CUDA device"),
        (0, "gpu0", 1.0, "not a device string"),
        (0, "cpu", 0.0, "setup_timeout"),
    ],
)
def test_bad_arguments_raise_config_error(
    rank: int, device: str, setup_timeout: float, match: str
) -> None:
    clique_id = CliqueId.new("127.0.0.1", 1, nranks=2)
    with pytest.raises(lampdist.ConfigError, match=match):
        open_clique(
            nranks=2, rank=rank, device=device, clique_id=clique_id, setup_timeout=setup_timeout
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")
def test_cuda_without_cuda_is_refused() -> None:
    with pytest.raises(lampdist.ConfigError, match="cpu"):
        open_clique(nranks=1, rank=0, device=0, clique_id=CliqueId.new("127.0.0.1", 1, nranks=1))


@pytest.mark.parametrize("rank", [0, 1])
async def test_setup_times_out_when_a_peer_never_comes(rank: int) -> None:
    threads, fds = live_threads(), open_fds()
    with anyio.fail_after(10):
        async with serve_rendezvous(nranks=2) as clique_id:
            with pytest.raises(lampdist.CliqueTimeout) as caught:
                async with open_rank(clique_id, rank, "cpu", setup_timeout=0.5):
                    pass
    assert (caught.value.rank, caught.value.phase) == (rank, "clique setup")
    assert live_threads() <= threads + 2
    assert open_fds() <= fds + 2


@contextmanager
def dropping_listener() -> Iterator[int]:
    """A port that accepts every connection and resets it at once: a rendezvous store whose
    rank 0 died between a peer's connect and its handshake."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        done.set()
        thread.join()
        server.close()


async def test_cancelling_a_rank_whose_store_drops_it_ends_promptly() -> None:
    # The store's handshake fails over and over; torch would retry it for the whole
    # setup_timeout inside one uninterruptible call. Cancellation must still get through.
    with dropping_listener() as port:
        clique_id = CliqueId.new("127.0.0.1", port, nranks=2)
        start = time.monotonic()
        with anyio.fail_after(60), anyio.move_on_after(0.5) as scope:
            async with open_rank(clique_id, 1, "cpu", setup_timeout=60.0):
                pass
        assert scope.cancelled_caught
        assert time.monotonic() - start < 10.0  # one connect attempt, not the 60 s budget


async def test_a_store_that_drops_every_connection_times_the_setup_out() -> None:
    with dropping_listener() as port:
        clique_id = CliqueId.new("127.0.0.1", port, nranks=2)
        with anyio.fail_after(30), pytest.raises(lampdist.CliqueTimeout) as caught:
            async with open_rank(clique_id, 1, "cpu", setup_timeout=1.0):
                pass
    assert (caught.value.rank, caught.value.phase) == (1, "clique setup")


async def test_a_silent_peer_times_the_collective_out_and_hears_of_it() -> None:
    timed_out = anyio.Event()

    async def body(clique: Clique) -> str:
        if clique.rank == 0:
            with pytest.raises(lampdist.CliqueTimeout) as caught:
                await clique.all_reduce([torch.ones(3)])
            assert (caught.value.rank, caught.value.phase) == (0, "all_reduce")
            # the clique's timer or Gloo's own deadline, whichever fired first: same limit
            assert "collective_timeout=0.5 s" in str(caught.value)
            # When the clique's timer fired first, Gloo's own operation is still pending for
            # the rest of its 0.5 s: a peer that joined it now would complete it. Let it expire
            # (on a loaded machine the peer's all_reduce otherwise succeeded).
            await anyio.sleep(1.0)
            timed_out.set()
            return "timed out"
        await timed_out.wait()  # silent until rank 0 gave up and closed its clique
        # Either the abort notice or Gloo's own closing of the timed-out pairs gets here
        # first; both are a CollectiveFailed.
        with pytest.raises(lampdist.CollectiveFailed) as failed:
            await clique.all_reduce([torch.ones(3)])
        assert (failed.value.rank, failed.value.phase) == (1, "all_reduce")
        return "heard"

    with anyio.fail_after(15):
        assert await run_ranks(2, body, collective_timeout=0.5) == ["timed out", "heard"]


@pytest.mark.parametrize("cancelled_rank_waits", [False, True])
async def test_cancelling_one_rank_fails_the_others_promptly(cancelled_rank_waits: bool) -> None:
    # Three ranks; rank 0 waits in an all_reduce; rank 2 is cancelled, either idle or inside
    # the same all_reduce; rank 1 idles. Rank 0 must fail long before the 30 s timeout, rank 1
    # must hear of it while idle, and its next collective must fail. (Had rank 1 joined the
    # all_reduce before hearing, it could have completed it: cancelling a wait does not
    # cancel the collective, and rank 2's part was already under way.)
    started = anyio.Event()
    failed = anyio.Event()
    outcome: dict[int, str] = {}

    async def rank(clique_id: CliqueId, index: int, scope: anyio.CancelScope) -> None:
        with scope:
            async with open_rank(clique_id, index, "cpu", collective_timeout=30.0) as clique:
                if index == 0:
                    pending = clique.start_all_reduce([torch.ones(5)])
                    started.set()
                    with pytest.raises(lampdist.CollectiveFailed) as caught:
                        await pending
                    assert (caught.value.rank, caught.value.phase) == (0, "all_reduce")
                    outcome[index] = "failed"
                    failed.set()
                elif index == 2:
                    await started.wait()
                    if cancelled_rank_waits:
                        await clique.all_reduce([torch.ones(5)])
                    else:
                        await anyio.sleep_forever()
                else:
                    await failed.wait()
                    transport = clique._transport
                    assert isinstance(transport, GroupTransport)
                    while transport.group._failure is None:  # noqa: ASYNC110  # hears while idle
                        await anyio.sleep(0.01)
                    with pytest.raises(lampdist.CollectiveFailed, match="rank 2"):
                        await clique.all_reduce([torch.ones(5)])
                    outcome[index] = "failed"
            if index == 2:
                with pytest.raises(lampdist.CliqueError, match="closed"):
                    clique.start_all_reduce([torch.ones(1)])

    scopes = [anyio.CancelScope() for _ in range(3)]
    with anyio.fail_after(10):
        async with serve_rendezvous(nranks=3) as clique_id, anyio.create_task_group() as tg:
            for index in range(3):
                tg.start_soon(rank, clique_id, index, scopes[index])
            await started.wait()
            await anyio.sleep(0.05)  # let rank 2 reach its wait
            scopes[2].cancel()
    assert scopes[2].cancelled_caught
    assert outcome == {0: "failed", 1: "failed"}


async def test_an_error_in_one_rank_reaches_the_others() -> None:
    async def body(clique: Clique) -> None:
        if clique.rank == 0:
            raise ValueError("the batch was bad")
        with pytest.raises(lampdist.CollectiveFailed, match="ValueError: the batch was bad"):
            await clique.all_reduce([torch.ones(2)])

    with anyio.fail_after(10), pytest.RaisesGroup(ValueError):
        await run_ranks(2, body, collective_timeout=30.0)


async def test_leaving_with_an_unfinished_collective_raises_on_close() -> None:
    async def body(clique: Clique) -> None:
        if clique.rank == 0:
            clique.start_all_reduce([torch.ones(2)])  # rank 1 never joins
        else:
            await anyio.sleep_forever()

    async def rank(clique_id: CliqueId, index: int, tg: anyio.abc.TaskGroup) -> None:
        if index == 0:
            with pytest.raises(lampdist.CliqueTimeout) as caught:
                async with open_rank(clique_id, 0, "cpu", collective_timeout=0.5) as clique:
                    await body(clique)
            assert caught.value.phase == "clique teardown"
            tg.cancel_scope.cancel()
        else:
            async with open_rank(clique_id, 1, "cpu", collective_timeout=0.5) as clique:
                await body(clique)

    with anyio.fail_after(10):
        async with serve_rendezvous(nranks=2) as clique_id, anyio.create_task_group() as tg:
            for index in range(2):
                tg.start_soon(rank, clique_id, index, tg)


@pytest.mark.parametrize("count", [10, pytest.param(100, marks=pytest.mark.slow)])
async def test_open_and_close_cycles_leak_no_threads_or_descriptors(count: int) -> None:
    # Each opening connects to the rendezvous store; torch's store client looks up the name
    # of every address it connects to, which costs 5 s whenever the resolver drops a query
    # (one connection in 25 on the development sandbox): hence 100 cycles only as "slow".
    async def body(clique: Clique) -> None:
        tensor = torch.ones(3)
        await clique.all_reduce([tensor])
        assert tensor.tolist() == [2.0] * 3

    async def cycles(count: int) -> None:
        async with serve_rendezvous(nranks=2) as clique_id:
            for _ in range(count):
                async with anyio.create_task_group() as tg:
                    for index in range(2):
                        tg.start_soon(one, clique_id, index)

    async def one(clique_id: CliqueId, index: int) -> None:
        async with open_rank(clique_id, index, "cpu") as clique:
            await body(clique)

    with anyio.fail_after(30 + count):
        await cycles(2)  # warm up: worker threads, torch's lazy state
        threads, fds = live_threads(), open_fds()
        await cycles(count)
    assert live_threads() <= threads + 2
    assert open_fds() <= fds + 4


async def test_abort_wakes_a_blocked_waiter_and_tells_the_peers() -> None:
    aborted = anyio.Event()

    async def body(clique: Clique) -> str:
        if clique.rank == 1:  # never joins rank 0's all_reduce
            await aborted.wait()
            await anyio.sleep(0.5)  # the watcher polls for notices every 50 ms
            with pytest.raises(lampdist.CollectiveFailed) as caught:
                await clique.barrier()
            return str(caught.value)
        pending = clique.start_all_reduce([torch.ones(4)])

        def wait() -> str:
            with pytest.raises(lampdist.CollectiveFailed) as caught:
                pending.wait_blocking(None)  # the clique's own limit is 20 s
            return str(caught.value)

        outcome: list[str] = []
        async with anyio.create_task_group() as group:

            async def waiter() -> None:
                outcome.append(await anyio.to_thread.run_sync(wait))

            group.start_soon(waiter)
            await anyio.sleep(0.2)
            await anyio.to_thread.run_sync(clique.abort, "stopped by the test")
        aborted.set()
        with pytest.raises(lampdist.CollectiveFailed):  # broken for good
            await clique.barrier()
        return outcome[0]

    with anyio.fail_after(10):
        mine, theirs = await run_ranks(2, body)
    assert "torn down on rank 0: stopped by the test" in mine
    assert "rank 0" in theirs and "stopped by the test" in theirs


async def test_rank_0_leaves_only_after_its_followers_have_released_their_cliques() -> None:
    """Leaving cleanly, rank 0 waits for every follower's goodbye before its clique (and the
    rendezvous store after it) closes: no follower's watcher asks a store that has gone."""
    left: dict[int, float] = {}
    closed: dict[int, float] = {}

    async def rank(clique_id: CliqueId, index: int) -> None:
        async with open_rank(clique_id, index, "cpu") as clique:
            await clique.barrier()
            if index == 1:
                await anyio.sleep(0.5)  # the fault: a follower slow to leave
            left[index] = time.monotonic()
        closed[index] = time.monotonic()

    with anyio.fail_after(15):
        async with serve_rendezvous(nranks=2) as clique_id, anyio.create_task_group() as group:
            for index in range(2):
                group.start_soon(rank, clique_id, index)
    assert closed[0] >= left[1], (closed, left)
