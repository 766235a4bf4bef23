"""A rank cancelled while it opens the clique is free at once and frees its peers: the setup
waits in short slices that notice cancellation and the peers' abort notices, rather than
sitting in a blocking call until ``setup_timeout``."""

from __future__ import annotations

import time

import anyio
import pytest

import lampdist
from lampdist.clique import CliqueId, open_clique, serve_rendezvous

SETUP_TIMEOUT = 60.0  # far beyond the deadlines below: only cancellation can end the waits


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def open_rank(clique_id: CliqueId, rank: int) -> None:
    async with open_clique(
        nranks=clique_id.nranks,
        rank=rank,
        device="cpu",
        clique_id=clique_id,
        setup_timeout=SETUP_TIMEOUT,
    ):
        await anyio.sleep_forever()


@pytest.mark.parametrize("rank", [0, 1], ids=["root waits for a follower", "follower waits"])
async def test_cancelling_a_rank_in_setup_frees_it_at_once(rank: int) -> None:
    # Rank ``rank`` opens a two-rank clique whose other rank never comes.
    async with serve_rendezvous(nranks=2) as clique_id:
        with anyio.fail_after(10):
            with anyio.move_on_after(0.5) as scope:
                await open_rank(clique_id, rank)
        assert scope.cancelled_caught
        assert time.monotonic() - scope.deadline < 5.0  # not SETUP_TIMEOUT


async def test_a_rank_cancelled_in_setup_fails_the_others_naming_it() -> None:
    # Ranks 0 and 1 wait for rank 2, which never comes; rank 1 is cancelled.
    outcome: dict[int, BaseException] = {}
    failed_at: list[float] = []

    async def rank0(clique_id: CliqueId) -> None:
        try:
            await open_rank(clique_id, 0)
        except lampdist.LampdistError as exc:
            outcome[0] = exc
            failed_at.append(time.monotonic())

    async with serve_rendezvous(nranks=3) as clique_id:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:
                group.start_soon(rank0, clique_id)
                with anyio.move_on_after(1.0) as scope:
                    await open_rank(clique_id, 1)
    assert failed_at[0] - scope.deadline < 5.0  # not SETUP_TIMEOUT
    error = outcome[0]
    assert isinstance(error, lampdist.CollectiveFailed)
    assert (error.rank, error.phase) == (0, "clique setup")
    assert "rank 1 left the clique during setup: cancelled" in str(error)
