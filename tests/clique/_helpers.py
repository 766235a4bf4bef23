"""Shared pieces of the clique tests: in-process ranks, expected arithmetic, fd/thread counts."""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import TypeVar

import anyio
import torch
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from lampdist.clique import Clique, CliqueId, open_clique, serve_rendezvous
from lampdist.clique._clique import _open

T = TypeVar("T")

WORKER = Path(__file__).with_name("_worker.py")
ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32, torch.bfloat16)


def worker_env() -> dict[str, str]:
    """The environment of a worker subprocess: this checkout's ``src`` first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), str(ROOT), env.get("PYTHONPATH")]))
    return env


def worker_command(*args: str) -> list[str]:
    return [sys.executable, str(WORKER), *args]


def open_rank(
    clique_id: CliqueId,
    rank: int,
    device: torch.device | str,
    *,
    threaded: bool = False,
    setup_timeout: float | None = 20.0,
    collective_timeout: float | None = 20.0,
    limiter: anyio.CapacityLimiter | None = None,
) -> AbstractAsyncContextManager[Clique]:
    """``open_clique``, or its variant with an enqueue thread (the NCCL path) on Gloo too."""
    if not threaded:
        return open_clique(
            nranks=clique_id.nranks,
            rank=rank,
            device=device,
            clique_id=clique_id,
            setup_timeout=setup_timeout,
            collective_timeout=collective_timeout,
            limiter=limiter,
        )
    return _open(
        nranks=clique_id.nranks,
        rank=rank,
        device=torch.device(device),
        clique_id=clique_id,
        setup_timeout=setup_timeout,
        collective_timeout=collective_timeout,
        limiter=limiter,
        threaded=True,
    )


async def run_ranks(
    nranks: int,
    body: Callable[[Clique], Awaitable[T]],
    *,
    devices: Sequence[torch.device | str] | None = None,
    threaded: bool = False,
    collective_timeout: float | None = 20.0,
    limiter: anyio.CapacityLimiter | None = None,
) -> list[T]:
    """Run ``body`` on every rank of a fresh clique, one task per rank, in this process."""
    results: dict[int, T] = {}
    chosen = list(devices) if devices is not None else ["cpu"] * nranks

    async def one(clique_id: CliqueId, rank: int) -> None:
        async with open_rank(
            clique_id,
            rank,
            chosen[rank],
            threaded=threaded,
            collective_timeout=collective_timeout,
            limiter=limiter,
        ) as clique:
            results[rank] = await body(clique)

    async with serve_rendezvous(nranks=nranks) as clique_id, anyio.create_task_group() as tg:
        for rank in range(nranks):
            tg.start_soon(one, clique_id, rank)
    return [results[rank] for rank in range(nranks)]


def values(rank: int, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Rank-specific small integers, exact in every dtype we test (bfloat16 included)."""
    return ((torch.arange(numel) % 7) + 3 * rank + 1).to(dtype=dtype, device=device)


def total(nranks: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return sum(
        (values(rank, numel, torch.int64, "cpu") for rank in range(nranks)),
        torch.zeros(numel, dtype=torch.int64),
    ).to(dtype)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def live_threads() -> int:
    gc.collect()
    return threading.active_count()


class Worker:
    """A rank in a subprocess of its own (see ``_worker.py``)."""

    def __init__(self, process: Process) -> None:
        self.process = process
        assert process.stdout is not None
        self._stdout = BufferedByteReceiveStream(process.stdout)

    async def line(self) -> str:
        """The next line the worker prints."""
        return (await self._stdout.receive_until(b"\n", 1 << 16)).decode().strip()

    async def send(self, text: str) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send(text.encode())


@asynccontextmanager
async def spawn_worker(
    clique_id: CliqueId, rank: int, mode: str, **extra: object
) -> AsyncIterator[Worker]:
    """Start ``_worker.py`` as ``rank`` of the clique; kill it on exit if it still runs."""
    config = {**clique_id.to_json(), "rank": rank, "mode": mode, **extra}
    process = await anyio.open_process(
        worker_command(json.dumps(config)), env=worker_env(), stderr=None
    )
    try:
        yield Worker(process)
    finally:
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                with anyio.move_on_after(5):
                    await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
            await process.aclose()
