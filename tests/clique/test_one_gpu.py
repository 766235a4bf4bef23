"""Cliques on one GPU: the in-process clique's NCCL path, and a process group of one rank whose
collectives are issued on the calling thread (run on the GPU machine: tests/run_gpu.py)."""

from __future__ import annotations

import threading

import anyio
import anyio.to_thread
import pytest
import torch
import torch.distributed as dist

from lampdist.clique import Clique, in_process, open_clique, serve_rendezvous

from .checks import check_collectives, check_started_collectives

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not dist.is_nccl_available(),
        reason="needs a CUDA device and NCCL",
    ),
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def issuing_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("lampdist-clique-issue")]


def from_a_plain_thread(clique: Clique) -> list[float]:
    """A rank's compute thread: start and wait, no event loop."""
    tensor = torch.arange(4, dtype=torch.float32, device=clique.device)
    clique.start_all_reduce([tensor]).wait_blocking(30.0)
    clique.start_broadcast([tensor]).wait_blocking(30.0)
    return list(tensor.cpu().tolist())


async def test_in_process_clique_on_one_gpu_runs_every_collective_through_nccl() -> None:
    cliques = in_process(["cuda:0"], collective_timeout=60.0)
    with anyio.fail_after(120):
        async with cliques.hub.open(0) as clique:
            await check_collectives(clique)
            await check_started_collectives(clique)
            assert await anyio.to_thread.run_sync(from_a_plain_thread, clique) == [0, 1, 2, 3]


async def test_nccl_collectives_from_a_thread_are_issued_on_it() -> None:
    with anyio.fail_after(120):
        async with (
            serve_rendezvous(nranks=1) as clique_id,
            open_clique(nranks=1, rank=0, device="cuda:0", clique_id=clique_id) as clique,
        ):
            assert clique.backend == "nccl"
            result = await anyio.to_thread.run_sync(from_a_plain_thread, clique)
            assert result == [0, 1, 2, 3]
            assert issuing_threads() == []  # the calling thread issued them
            await check_collectives(clique)  # from the event loop: handed off
            assert issuing_threads() == ["lampdist-clique-issue-0"]
            await check_started_collectives(clique)
    assert issuing_threads() == []
