"""The clique on NCCL: one rank per GPU, in one process and in two (needs 2 CUDA devices).

Run them on a machine with 2 GPUs, each in its own process: ``python3 tests/run_gpu.py``.
"""

from __future__ import annotations

import signal

import anyio
import pytest
import torch
import torch.distributed as dist

import lampdist
from lampdist.clique import Clique, CliqueId, serve_rendezvous

from ._helpers import live_threads, open_fds, open_rank, run_ranks, spawn_worker
from .checks import check_collectives, check_started_collectives

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
        reason="needs 2 CUDA devices and NCCL",
    ),
]

DEVICES = ["cuda:0", "cuda:1"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_nccl_collectives_one_rank_per_gpu_in_one_process() -> None:
    async def body(clique: Clique) -> str:
        await check_collectives(clique)
        await check_started_collectives(clique)
        return clique.backend

    with anyio.fail_after(120):
        assert await run_ranks(2, body, devices=DEVICES) == ["nccl", "nccl"]


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_nccl_bridge_on_trio() -> None:
    pytest.importorskip("trio")
    with anyio.fail_after(120):
        await run_ranks(2, check_started_collectives, devices=DEVICES)


async def test_nccl_two_processes() -> None:
    with anyio.fail_after(180):
        async with (
            serve_rendezvous(nranks=2) as clique_id,
            spawn_worker(clique_id, 1, "check", device=DEVICES[1], cycles=2) as worker,
        ):
            for _ in range(2):
                async with open_rank(clique_id, 0, DEVICES[0], setup_timeout=120.0) as clique:
                    await check_collectives(clique)
                    await check_started_collectives(clique)
            assert await worker.line() == "ok"
            assert await worker.process.wait() == 0


async def test_nccl_several_cliques_at_once() -> None:
    async def rank(first: CliqueId, second: CliqueId, index: int, out: dict[int, float]) -> None:
        device = DEVICES[index]
        async with open_rank(first, index, device) as a, open_rank(second, index, device) as b:
            x = torch.full((4,), float(index + 1), device=device)
            y = torch.full((4,), 10.0 * (index + 1), device=device)
            pending = a.start_all_reduce([x])
            await b.all_reduce([y])
            await pending
            out[index] = float((x + y)[0])

    out: dict[int, float] = {}
    with anyio.fail_after(120):
        async with (
            serve_rendezvous(nranks=2) as first,
            serve_rendezvous(nranks=2) as second,
            anyio.create_task_group() as tg,
        ):
            for index in range(2):
                tg.start_soon(rank, first, second, index, out)
    assert out == {0: 33.0, 1: 33.0}


async def test_nccl_cancelling_one_rank_fails_the_other_promptly() -> None:
    # On NCCL an awaited collective returns once it is ordered on the stream; the barrier
    # waits for the GPU, so it is where rank 0 learns that rank 1 was cancelled.
    started = anyio.Event()
    scopes = [anyio.CancelScope() for _ in range(2)]

    async def rank(clique_id: CliqueId, index: int) -> None:
        with scopes[index]:
            async with open_rank(clique_id, index, DEVICES[index], collective_timeout=60) as c:
                await c.all_reduce([torch.ones(8, device=c.device)])
                if index == 0:
                    started.set()
                    with anyio.fail_after(10), pytest.raises(lampdist.CollectiveFailed):
                        await c.barrier()
                else:
                    await anyio.sleep_forever()

    with anyio.fail_after(120):
        async with serve_rendezvous(nranks=2) as clique_id, anyio.create_task_group() as tg:
            for index in range(2):
                tg.start_soon(rank, clique_id, index)
            await started.wait()
            scopes[1].cancel()
    assert scopes[1].cancelled_caught


async def test_nccl_barrier_waits_for_every_ranks_gpu_work() -> None:
    # Rank 1 queues about 0.2 s of GPU work before the barrier; rank 0 leaves the barrier
    # only after that work has run.
    before: dict[int, torch.cuda.Event] = {}

    async def body(clique: Clique) -> bool:
        if clique.rank == 1:
            with torch.cuda.device(clique.device):
                torch.cuda._sleep(int(0.2 * 1.98e9))  # type: ignore[no-untyped-call]  # ~2 GHz
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch
        event.record(torch.cuda.current_stream(clique.device))
        before[clique.rank] = event
        await clique.barrier()
        return all(bool(each.query()) for each in before.values())  # type: ignore[no-untyped-call]

    with anyio.fail_after(120):
        assert await run_ranks(2, body, devices=DEVICES) == [True, True]


async def test_nccl_silent_peer_times_out() -> None:
    release = anyio.Event()

    async def body(clique: Clique) -> None:
        if clique.rank == 0:
            with anyio.fail_after(30), pytest.raises(lampdist.CliqueTimeout):
                await clique.barrier()
            release.set()
        else:
            await release.wait()

    with anyio.fail_after(120):
        await run_ranks(2, body, devices=DEVICES, collective_timeout=3.0)


async def test_nccl_killed_peer_fails_the_other_promptly() -> None:
    with anyio.fail_after(180):
        async with (
            serve_rendezvous(nranks=2) as clique_id,
            spawn_worker(clique_id, 1, "idle", device=DEVICES[1]) as worker,
        ):
            async with open_rank(clique_id, 0, DEVICES[0], setup_timeout=120.0) as clique:
                assert await worker.line() == "ready"
                # a collective the worker never joins is in flight when it dies
                pending = clique.start_all_reduce([torch.ones(4, device=clique.device)])
                worker.process.send_signal(signal.SIGKILL)

                async def pending_then_barrier() -> None:
                    await pending
                    await clique.barrier()

                with anyio.fail_after(10), pytest.raises(lampdist.CollectiveFailed):
                    await pending_then_barrier()
            assert await worker.process.wait() == -signal.SIGKILL


async def test_nccl_open_close_cycles_leak_nothing() -> None:
    async def body(clique: Clique) -> None:
        tensor = torch.ones(3, device=clique.device)
        await clique.all_reduce([tensor])
        await clique.barrier()

    with anyio.fail_after(300):
        await run_ranks(2, body, devices=DEVICES)  # warm up: CUDA contexts, NCCL's own state
        threads, fds = live_threads(), open_fds()
        for _ in range(10):
            await run_ranks(2, body, devices=DEVICES)
    assert live_threads() <= threads + 2
    assert open_fds() <= fds + 16
