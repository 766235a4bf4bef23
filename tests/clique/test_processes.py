"""Ranks in separate processes: the arithmetic, clean exits, and a peer killed mid-collective."""

from __future__ import annotations

import signal

import anyio
import pytest
import torch

import lampdist
from lampdist.clique import serve_rendezvous

from ._helpers import open_rank, spawn_worker
from .checks import check_collectives, check_started_collectives


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_two_processes_agree_and_exit_cleanly_over_several_runs() -> None:
    # A process group or work object alive at exit aborts the process in about one run of
    # six. Three runs side by side: rank 0 here, rank 1 in a subprocess, every collective
    # checked in two openings of the clique; every subprocess must exit 0.
    codes: list[int] = []

    async def run() -> None:
        async with (
            serve_rendezvous(nranks=2) as clique_id,
            spawn_worker(clique_id, 1, "check", cycles=2) as worker,
        ):
            for _ in range(2):
                async with open_rank(clique_id, 0, "cpu", setup_timeout=60.0) as clique:
                    await check_collectives(clique)
                    await check_started_collectives(clique)
            assert await worker.line() == "ok"
            codes.append(await worker.process.wait())

    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(run)
    assert codes == [0, 0, 0]


async def test_a_killed_peer_makes_the_others_raise_promptly() -> None:
    # Rank 1 sits in an all_reduce that rank 0 joins; rank 2 idles. Killing rank 1 must fail
    # rank 0's all_reduce within seconds, and rank 2's next collective must fail too.
    with anyio.fail_after(60):
        async with (
            serve_rendezvous(nranks=3) as clique_id,
            spawn_worker(clique_id, 1, "allreduce") as killed,
            spawn_worker(clique_id, 2, "idle") as idle,
        ):
            async with open_rank(clique_id, 0, "cpu", collective_timeout=30.0) as clique:
                assert await killed.line() == "ready"
                assert await idle.line() == "ready"
                pending = clique.start_all_reduce([torch.ones(4)])
                killed.process.send_signal(signal.SIGKILL)
                with anyio.fail_after(5), pytest.raises(lampdist.CollectiveFailed) as caught:
                    await pending
                assert (caught.value.rank, caught.value.phase) == (0, "all_reduce")
                with pytest.raises(lampdist.CollectiveFailed):
                    await clique.barrier()  # the clique stays broken
            await idle.send("go\n")
            assert await idle.line() == "raised CollectiveFailed"
            assert await idle.process.wait() == 3  # an exception, not a signal
            assert await killed.process.wait() == -signal.SIGKILL
