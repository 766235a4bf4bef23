"""Load and soak: many followers on one root, and a long run that must not leak.

Both run in this process, over real TCP sockets on 127.0.0.1. Measurements are printed
(``pytest -s``) for docs/reliability.md.
"""

from __future__ import annotations

import functools
import gc
import os
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
import torch

import lampdist
from lampdist import checkpoint, control
from lampdist._clique_id import CliqueId
from lampdist.control import Command, CommandKind

from ..roles.reference import make_model, make_shards, mse
from . import rank as rank_script

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

SECRET = "soak"
FOLLOWERS = 64
COMMANDS = 1000
EPOCHS = 1000
MEASURE_AT = (100, EPOCHS)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def commands() -> list[Command]:
    """COMMANDS commands: TRAIN and VALID alternating, then STOP."""
    out = [
        Command(kind=CommandKind.TRAIN, epoch=i // 2, pass_index=i, lr_factor=1.0 / (1 + i))
        if i % 2 == 0
        else Command(kind=CommandKind.VALID, epoch=i // 2, pass_index=i)
        for i in range(COMMANDS - 1)
    ]
    return [*out, Command(kind=CommandKind.STOP, epoch=COMMANDS // 2, pass_index=COMMANDS - 1)]


async def test_64_followers_receive_1000_commands_in_order() -> None:
    sequence = commands()
    received: dict[int, list[Command]] = {rank: [] for rank in range(1, FOLLOWERS + 1)}

    async def follow(rank: int, address: tuple[str, int]) -> None:
        channel = control.tcp_follower(*address, rank=rank, secret=SECRET, join_timeout=60)
        send, receive = anyio.create_memory_object_stream[Command](10)
        async with channel, receive:
            await channel.join(send)
            async for command in receive:
                received[rank].append(command)

    started = time.perf_counter()
    with anyio.fail_after(300):
        async with control.tcp_root(nranks=FOLLOWERS + 1, secret=SECRET) as root:
            await root.publish_clique_id(CliqueId.new("127.0.0.1", 1, nranks=FOLLOWERS + 1))
            async with anyio.create_task_group() as group:
                for rank in received:
                    group.start_soon(follow, rank, root.address)
                await root.wait_for_peers(FOLLOWERS, timeout=60)
                joined = time.perf_counter()
                for command in sequence:
                    await root.broadcast(command)
                sent = time.perf_counter()
    for rank, got in received.items():
        assert got == sequence, f"rank {rank}"
    per_broadcast = (sent - joined) / COMMANDS * 1e3
    print(
        f"\nSOAK | {FOLLOWERS} followers joined in {joined - started:.2f} s | "
        f"{COMMANDS} broadcasts in {sent - joined:.2f} s ({per_broadcast:.2f} ms each)"
    )


@attrs.frozen(kw_only=True)
class Usage:
    threads: int
    fds: int
    rss_mb: float

    @classmethod
    def now(cls) -> Usage:
        gc.collect()
        status = Path("/proc/self/status").read_text()
        rss_kb = next(int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmRSS"))
        return cls(
            threads=threading.active_count(),
            fds=len(os.listdir("/proc/self/fd")),
            rss_mb=rss_kb / 1024,
        )


async def test_a_1000_epoch_run_keeps_threads_descriptors_and_memory_flat(
    tmp_path: Path,
) -> None:
    shards = make_shards([[4, 4], [4, 4]], seed=31)
    valid = make_shards([[4], [4]], seed=32)
    modules = [make_model(seed=0), make_model(seed=1)]
    usage: dict[int, Usage] = {}
    write = checkpoint.to_directory(tmp_path, keep=3)

    async def checkpoint_and_measure(state: lampdist.TrainingState, lr_state: Any) -> None:
        await write(state, lr_state)
        if state.loop_state.epoch in MEASURE_AT:
            usage[state.loop_state.epoch] = Usage.now()

    async def follow(root: control.TcpRootChannel) -> None:
        channel = control.tcp_follower(*root.address, rank=1, secret=SECRET)
        async with channel:
            await lampdist.follow_distributed_training(
                data=lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(modules[1], mse),
                    train_batches=functools.partial(list, shards[1]),
                    validation_batches=functools.partial(list, valid[1]),
                ),
                rank=1,
                nranks=2,
                device="cpu",
                control=channel,
            )

    started = time.perf_counter()
    with anyio.fail_after(480):
        async with (
            control.tcp_root(nranks=2, secret=SECRET) as root,
            anyio.create_task_group() as group,
        ):
            group.start_soon(follow, root)
            state = await lampdist.drive_distributed_training(
                data=lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(modules[0], mse),
                    train_batches=functools.partial(list, shards[0]),
                    validation_batches=functools.partial(list, valid[0]),
                ),
                nranks=2,
                device="cpu",
                control=root,
                optimizer_factory=rank_script.sgd,
                loop=lampdist.LoopOptions(
                    max_epochs=EPOCHS, checkpoint_state=checkpoint_and_measure
                ),
            )
    took = time.perf_counter() - started
    assert state.epoch == EPOCHS
    for a, b in zip(modules[0].parameters(), modules[1].parameters(), strict=True):
        assert torch.equal(a, b)
    early, late = usage[MEASURE_AT[0]], usage[MEASURE_AT[1]]
    print(
        f"\nSOAK | {EPOCHS} epochs in {took:.1f} s | epoch {MEASURE_AT[0]}: {early} | "
        f"epoch {MEASURE_AT[1]}: {late}"
    )
    assert late.threads <= early.threads + 2  # anyio's idle worker threads come and go
    assert late.fds <= early.fds + 2
    assert late.rss_mb <= early.rss_mb + 8  # 900 more curve points, allocator slack
