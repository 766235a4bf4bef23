"""The TCP root before authentication: bounds on the connections in their handshake, an
accept loop that outlives running out of descriptors, and refusals logged at a bounded
rate. Real sockets on 127.0.0.0/8 (every address of it is this machine on Linux, which lets
one test play several sources)."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import pytest
from anyio.abc import SocketAttribute, SocketStream

import lampdist
from lampdist import control
from lampdist.control import Command, TcpRootChannel
from lampdist.control import _admission as admission

from ._support import SECRET, SEQUENCE, TCP_SETTINGS, FollowerRun, clique_id, run_follower

pytestmark = pytest.mark.anyio

FAST = TCP_SETTINGS
HTTP = b"GET / HTTP/1.1\r\nHost: root\r\n\r\n"


def follower_of(root: TcpRootChannel, rank: int) -> control.TcpFollowerChannel:
    return control.tcp_follower(*root.address, rank=rank, secret=SECRET, join_timeout=10, **FAST)


def warnings_in(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.levelno == logging.WARNING and record.name.startswith("lampdist.control")
    ]


async def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:  # noqa: ASYNC109
    with anyio.fail_after(timeout):
        while not condition():  # noqa: ASYNC110  # polls the root's state or the log
            await anyio.sleep(0.01)


Connect = Callable[[TcpRootChannel, str], Awaitable[SocketStream]]


@contextlib.asynccontextmanager
async def connections() -> AsyncIterator[Connect]:
    """Open idle connections to a root from a chosen source address; all closed at the end."""
    async with contextlib.AsyncExitStack() as stack:

        async def connect(root: TcpRootChannel, source: str) -> SocketStream:
            stream = await anyio.connect_tcp(*root.address, local_host=source)
            return await stack.enter_async_context(stream)

        yield connect


async def closed_by_the_root(stream: SocketStream, within: float) -> bool:
    """Whether the root closes ``stream`` within ``within`` seconds (it sends nothing first)."""
    with anyio.move_on_after(within):
        try:
            data = await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            return True
        raise AssertionError(f"the root sent {data!r} to a peer that said nothing")
    return False


async def joined(
    root: TcpRootChannel, rank: int, run: FollowerRun, group: anyio.abc.TaskGroup
) -> None:
    group.start_soon(run_follower, follower_of(root, rank), run)
    with anyio.fail_after(10):
        await run.joined.wait()


async def finish(root: TcpRootChannel, *runs: FollowerRun) -> None:
    for command in SEQUENCE:
        await root.broadcast(command)
    await wait_until(lambda: all(run.ended for run in runs))
    for run in runs:
        assert run.commands == SEQUENCE


# -- bounds ----------------------------------------------------------------------------------


async def test_one_address_gets_so_many_handshakes_and_the_next_is_closed_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="lampdist.control")
    run = FollowerRun()
    with anyio.fail_after(30):
        async with (
            control.tcp_root(nranks=2, secret=SECRET, handshake_timeout=60, **FAST) as root,
            connections() as connect,
            anyio.create_task_group() as group,
        ):
            await root.publish_clique_id(clique_id(2))
            per_host = admission.MAX_UNAUTHENTICATED_PER_HOST + 1  # and one per follower
            held = [await connect(root, "127.0.0.2") for _ in range(per_host)]
            over = await connect(root, "127.0.0.2")
            assert await closed_by_the_root(over, within=5)  # not the 60 s deadline
            assert not await closed_by_the_root(held[-1], within=0.2)
            await joined(root, 1, run, group)  # from 127.0.0.1, beside the full 127.0.0.2
            assert not await closed_by_the_root(held[0], within=0.01)
            await finish(root, run)
    busy = [line for line in warnings_in(caplog) if "from one address" in line]
    assert len(busy) == 1
    assert busy[0].startswith("refused a control connection from 127.0.0.2:")


async def test_the_root_gets_so_many_handshakes_and_the_next_is_closed_at_once() -> None:
    first, second = FollowerRun(), FollowerRun()
    with anyio.fail_after(30):
        async with (
            control.tcp_root(nranks=3, secret=SECRET, handshake_timeout=60, **FAST) as root,
            anyio.create_task_group() as group,
        ):
            await root.publish_clique_id(clique_id(3))
            await joined(root, 1, first, group)
            limit = admission.MAX_UNAUTHENTICATED + 2  # and one per follower
            per_host = admission.MAX_UNAUTHENTICATED_PER_HOST + 2
            async with connections() as connect:
                held = [await connect(root, f"127.0.0.{2 + i // per_host}") for i in range(limit)]
                over = await connect(root, "127.0.0.200")  # an address of its own
                assert await closed_by_the_root(over, within=5)
                assert not await closed_by_the_root(held[-1], within=0.2)
                # A joiner is turned away too while the strangers hold every place...
                send, receive = anyio.create_memory_object_stream[Command](1)
                async with follower_of(root, 2) as turned_away, receive:
                    with pytest.raises(lampdist.JoinRejected, match="flooded"):
                        await turned_away.join(send)
                await root.broadcast(SEQUENCE[0])  # ...but the follower that joined goes on
                await wait_until(lambda: first.commands == SEQUENCE[:1])
            # The strangers gone, their places are free again.
            await wait_until(lambda: root._admission.pending == 0)
            await joined(root, 2, second, group)
            for command in SEQUENCE[1:]:
                await root.broadcast(command)
            await wait_until(lambda: first.ended and second.ended)
    assert first.commands == SEQUENCE
    assert second.commands == SEQUENCE[1:]  # those broadcast since it joined


# -- the accept loop -------------------------------------------------------------------------


def lowest_free_descriptor() -> int:
    probe = os.dup(0)
    os.close(probe)
    return probe


async def test_the_root_accepts_again_once_descriptors_are_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="lampdist.control")
    run = FollowerRun()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with anyio.fail_after(30), socket.socket() as stray:
        async with (
            control.tcp_root(nranks=2, secret=SECRET, **FAST) as root,
            anyio.create_task_group() as group,
        ):
            await root.publish_clique_id(clique_id(2))
            stray.setblocking(False)
            try:
                # No descriptor left: the root's accept of the stray connection fails (EMFILE).
                resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free_descriptor(), hard))
                stray.connect_ex(root.address)
                await wait_until(lambda: "Too many open files" in "\n".join(warnings_in(caplog)))
                await anyio.sleep(0.1)  # a few retries, each failing
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            await wait_until(lambda: root._admission.pending == 1)  # the stray, accepted now
            await joined(root, 1, run, group)
            await finish(root, run)
    accept_lines = [line for line in warnings_in(caplog) if "could not accept" in line]
    assert "retrying in 0.01 s" in accept_lines[0]
    # The retries are counted into one line at the close, not logged one by one.
    assert len(accept_lines) == 2, accept_lines
    assert accept_lines[1].startswith("accepting a control connection failed ")


async def test_a_failed_listener_ends_the_channel_naming_the_root() -> None:
    with anyio.fail_after(20):
        async with control.tcp_root(nranks=2, secret=SECRET, **FAST) as root:
            assert root._listener is not None
            [listener] = root._listener.listeners
            listener.extra(SocketAttribute.raw_socket).shutdown(socket.SHUT_RDWR)  # EINVAL
            with pytest.raises(lampdist.ControlError, match=r"listener .* failed") as failed:
                await root.watch()
            assert (failed.value.rank, failed.value.phase) == (0, "join")
            with pytest.raises(lampdist.ControlError, match="no follower can join"):
                await root.wait_for_peers(1, timeout=1)


# -- how loudly ------------------------------------------------------------------------------


async def refuse(root: TcpRootChannel, times: int) -> None:
    """``times`` connections that speak HTTP, each refused with a protocol error."""
    for _ in range(times):
        async with await anyio.connect_tcp(*root.address) as raw:
            await raw.send(HTTP)
            with anyio.fail_after(5):
                with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                    while True:
                        await raw.receive()


async def test_refusals_are_counted_into_one_line_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="lampdist.control")
    with anyio.fail_after(30):
        async with control.tcp_root(nranks=2, secret=SECRET, **FAST) as root:
            await refuse(root, 50)
    lines = warnings_in(caplog)
    assert len(lines) == 2, lines
    assert lines[0].startswith("refused a control connection from 127.0.0.1:")
    assert lines[1].startswith("refused 49 more control connections in the last ")
    assert (
        ": protocol errors; the latest: refused a control connection from 127.0.0.1:" in (lines[1])
    )


async def test_the_count_goes_out_when_the_interval_ends(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger="lampdist.control")
    monkeypatch.setattr(admission, "WARNING_INTERVAL", 0.3)
    with anyio.fail_after(30):
        async with control.tcp_root(nranks=2, secret=SECRET, **FAST) as root:
            await refuse(root, 5)
            await wait_until(lambda: len(warnings_in(caplog)) == 2)  # while the root is open
            assert "refused 4 more control connections" in warnings_in(caplog)[1]
            await anyio.sleep(0.4)
            await refuse(root, 1)  # a new interval: a line of its own
            assert len(warnings_in(caplog)) == 3
    assert len(warnings_in(caplog)) == 3  # nothing was held back at the close
