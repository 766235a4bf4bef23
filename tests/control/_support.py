"""Helpers shared by the control-plane tests: open either implementation, run followers."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import attrs

from lampdist import control
from lampdist._clique_id import CliqueId
from lampdist.control import Command, CommandKind, FollowerChannel, RootChannel

SECRET = "correct horse battery staple"
#: Heartbeats fast enough to notice a vanished peer in a test, slow enough for a busy machine.
TCP_SETTINGS: dict[str, Any] = {"heartbeat_interval": 0.1, "heartbeat_timeout": 3.0}

SEQUENCE = [
    Command(kind=CommandKind.TRAIN, epoch=0, pass_index=0, lr_factor=1.0),
    Command(kind=CommandKind.VALID, epoch=0, pass_index=1),
    Command(kind=CommandKind.TRAIN, epoch=1, pass_index=2, lr_factor=0.5),
    Command(kind=CommandKind.STOP, epoch=1, pass_index=3),
]

FollowerFactory = Callable[[int], FollowerChannel]


def clique_id(nranks: int) -> CliqueId:
    return CliqueId.new("127.0.0.1", 29500, nranks=nranks)


@contextlib.asynccontextmanager
async def open_root(
    impl: str, nranks: int, **tcp: Any
) -> AsyncIterator[tuple[RootChannel, FollowerFactory]]:
    """An entered root of implementation ``impl`` and a factory of its followers' channels."""
    if impl == "memory":
        root, followers = control.local_channels(nranks, join_timeout=10.0)
        async with root:
            yield root, lambda rank: followers[rank - 1]
    else:
        settings = {**TCP_SETTINGS, **tcp}
        async with control.tcp_root(nranks=nranks, secret=SECRET, **settings) as tcp_root:
            host, port = tcp_root.address

            def follower(rank: int) -> FollowerChannel:
                return control.tcp_follower(
                    host, port, rank=rank, secret=SECRET, join_timeout=10.0, **settings
                )

            yield tcp_root, follower


@attrs.define(eq=False)
class FollowerRun:
    """What one follower saw."""

    clique: CliqueId | None = None
    commands: list[Command] = attrs.field(factory=list)
    joined: anyio.Event = attrs.field(factory=anyio.Event)
    ended: bool = False


async def run_follower(channel: FollowerChannel, run: FollowerRun) -> None:
    """Join, collect commands until the stream ends, leave."""
    send, receive = anyio.create_memory_object_stream[Command]()
    async with channel, receive:
        run.clique = await channel.join(send)
        run.joined.set()
        async for command in receive:
            run.commands.append(command)
    run.ended = True


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@attrs.define(eq=False)
class RootHandle:
    """A root held open by its own task, so that a test can close it in the middle."""

    root: RootChannel
    follower: FollowerFactory
    _close: anyio.Event
    _closed: anyio.Event

    async def close(self) -> None:
        self._close.set()
        await self._closed.wait()


async def _hold_root(
    impl: str,
    nranks: int,
    close: anyio.Event,
    closed: anyio.Event,
    *,
    task_status: anyio.abc.TaskStatus[RootHandle],
) -> None:
    try:
        async with open_root(impl, nranks) as (root, follower):
            task_status.started(RootHandle(root, follower, close, closed))
            await close.wait()
    finally:
        closed.set()


@contextlib.asynccontextmanager
async def root_in_task(impl: str, nranks: int) -> AsyncIterator[RootHandle]:
    """Like :func:`open_root`, but the root lives in a task of its own until closed."""
    async with anyio.create_task_group() as tg:
        handle: RootHandle = await tg.start(_hold_root, impl, nranks, anyio.Event(), anyio.Event())
        try:
            yield handle
        finally:
            await handle.close()
