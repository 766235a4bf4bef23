"""One suite over both control channels: the in-process one and TCP on 127.0.0.1."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

import lampdist
from lampdist import control
from lampdist.control import Command, CommandKind

from ._support import (
    SECRET,
    SEQUENCE,
    FollowerRun,
    RootHandle,
    clique_id,
    open_root,
    root_in_task,
    run_follower,
)

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["memory", "tcp"])
def impl(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.parametrize("nfollowers", [1, 3, 8])
async def test_commands_reach_every_follower_in_order(impl: str, nfollowers: int) -> None:
    nranks = nfollowers + 1
    cid = clique_id(nranks)
    runs = {rank: FollowerRun() for rank in range(1, nranks)}
    with anyio.fail_after(20):
        async with open_root(impl, nranks) as (root, follower):
            assert root.nranks == nranks
            await root.publish_clique_id(cid)
            async with anyio.create_task_group() as tg:
                for rank, run in runs.items():
                    tg.start_soon(run_follower, follower(rank), run)
                await root.wait_for_peers(nfollowers, timeout=10)
                assert await root.peers() == nfollowers
                for command in SEQUENCE:
                    await root.broadcast(command)
    for run in runs.values():
        assert run.clique == cid
        assert run.commands == SEQUENCE
        assert run.ended


async def test_followers_that_join_before_the_clique_id_wait_for_it(impl: str) -> None:
    nranks = 4
    cid = clique_id(nranks)
    early = {1: FollowerRun(), 2: FollowerRun()}
    late = FollowerRun()
    with anyio.fail_after(20):
        async with open_root(impl, nranks) as (root, follower), anyio.create_task_group() as tg:
            for rank, run in early.items():
                tg.start_soon(run_follower, follower(rank), run)
            await root.wait_for_peers(2, timeout=10)
            # registered, but join() cannot return before the clique id exists
            assert not any(run.joined.is_set() for run in early.values())
            await root.publish_clique_id(cid)
            await root.publish_clique_id(cid)  # the same id again is a no-op
            for run in early.values():
                await run.joined.wait()
            tg.start_soon(run_follower, follower(3), late)
            await root.wait_for_peers(3, timeout=10)
            for command in SEQUENCE:
                await root.broadcast(command)
    for run in [*early.values(), late]:
        assert run.clique == cid
        assert run.commands == SEQUENCE


async def test_stop_carries_the_root_error(impl: str) -> None:
    run = FollowerRun()
    stop = Command(kind=CommandKind.STOP, epoch=3, pass_index=7, error="boom: loss diverged")
    with anyio.fail_after(20):
        async with open_root(impl, 2) as (root, follower), anyio.create_task_group() as tg:
            await root.publish_clique_id(clique_id(2))
            tg.start_soon(run_follower, follower(1), run)
            await root.wait_for_peers(1, timeout=10)
            await root.broadcast(stop)
    assert run.commands == [stop]


async def test_leaving_after_stop_is_no_failure(impl: str) -> None:
    run = FollowerRun()
    with anyio.fail_after(20):
        async with open_root(impl, 2) as (root, follower):
            await root.publish_clique_id(clique_id(2))
            async with anyio.create_task_group() as tg:
                tg.start_soon(run_follower, follower(1), run)
                await root.wait_for_peers(1, timeout=10)
                await root.broadcast(SEQUENCE[-1])
            assert run.ended
            while await root.peers():  # noqa: ASYNC110  # until the leave is processed ...
                await anyio.sleep(0.01)
            with anyio.move_on_after(0.2) as scope:
                await root.watch()  # ... and is no failure
            assert scope.cancelled_caught


async def test_follower_watch_ignores_the_root_leaving_after_stop(impl: str) -> None:
    send, receive = anyio.create_memory_object_stream[Command](10)
    with anyio.fail_after(20):
        async with root_in_task(impl, 2) as handle:
            root, channel = handle.root, handle.follower(1)
            async with channel, receive:
                await root.publish_clique_id(clique_id(2))
                await channel.join(send)
                await root.broadcast(SEQUENCE[-1])
                assert [command async for command in receive] == [SEQUENCE[-1]]
                await handle.close()
                with anyio.move_on_after(0.5) as scope:
                    await channel.watch()
                assert scope.cancelled_caught


async def test_follower_leaving_without_stop_surfaces_on_watch_and_broadcast(impl: str) -> None:
    runs = {1: FollowerRun(), 2: FollowerRun()}
    with anyio.fail_after(20):
        async with open_root(impl, 3) as (root, follower):
            await root.publish_clique_id(clique_id(3))
            async with anyio.create_task_group() as tg:
                scopes = {}
                for rank, run in runs.items():
                    scopes[rank] = anyio.CancelScope()
                    tg.start_soon(_cancellable, scopes[rank], follower(rank), run)
                await root.wait_for_peers(2, timeout=10)
                await root.broadcast(SEQUENCE[0])
                scopes[2].cancel()  # rank 2 vanishes in the middle of the run
                with pytest.raises(lampdist.PeerDisconnected) as watched:
                    await root.watch()
                assert watched.value.rank == 2
                assert watched.value.phase == "train"
                with pytest.raises(lampdist.PeerDisconnected) as broadcast:
                    await root.broadcast(SEQUENCE[1])
                assert broadcast.value.rank == 2
                with pytest.raises(lampdist.PeerDisconnected):
                    await root.broadcast(SEQUENCE[-1])  # delivered to the survivor, then raised
            # the survivor got every command, including those of the failed broadcasts
    assert runs[1].commands == [SEQUENCE[0], SEQUENCE[1], SEQUENCE[-1]]


async def _cancellable(
    scope: anyio.CancelScope,
    channel: lampdist.control.FollowerChannel,
    run: FollowerRun,
) -> None:
    with scope:
        await run_follower(channel, run)


async def test_root_leaving_without_stop_surfaces_on_the_follower(impl: str) -> None:
    send, receive = anyio.create_memory_object_stream[Command](10)
    with anyio.fail_after(20):
        async with root_in_task(impl, 2) as handle:
            root, channel = handle.root, handle.follower(1)
            async with channel, receive:
                await root.publish_clique_id(clique_id(2))
                await channel.join(send)
                await root.broadcast(SEQUENCE[0])
                await handle.close()  # the root vanishes
                assert [command async for command in receive] == [SEQUENCE[0]]
                with pytest.raises(lampdist.PeerDisconnected) as watched:
                    await channel.watch()
                assert watched.value.rank == 0
                assert watched.value.phase == "train"
                with anyio.fail_after(5):  # best effort, bounded, never raises
                    await channel.report_failure("train", "too late: the root is gone")


@pytest.mark.parametrize("reported", [False, True])
async def test_a_follower_that_reported_its_failure_hears_the_root_go_quietly(
    impl: str, reported: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The root closing without STOP is news (a warning) to a follower, except to one that
    failed and said so: the root's going is then what it expects."""
    send, receive = anyio.create_memory_object_stream[Command](10)
    with anyio.fail_after(20):
        async with root_in_task(impl, 2) as handle:
            root, channel = handle.root, handle.follower(1)
            async with channel, receive:
                await root.publish_clique_id(clique_id(2))
                await channel.join(send)
                if reported:
                    await channel.report_failure("train", "the model raised")
                await handle.close()
                with pytest.raises(lampdist.PeerDisconnected):
                    await channel.watch()
    warned = [
        r for r in caplog.records if r.levelname == "WARNING" and "without STOP" in r.getMessage()
    ]
    assert bool(warned) is not reported, caplog.text


async def test_the_root_waits_until_a_follower_has_left() -> None:
    """Over TCP: the follower's process ends when its channel closes. (In process, the
    followers are tasks of the root's process: the wait returns at once.)"""
    impl = "tcp"
    send, receive = anyio.create_memory_object_stream[Command](10)
    with anyio.fail_after(20):
        async with open_root(impl, 3) as (root, follower):
            await root.publish_clique_id(clique_id(3))
            channel = follower(1)
            async with channel, receive:
                await channel.join(send)
                with anyio.move_on_after(0.2) as scope:  # rank 1 is still there
                    await root.wait_until_left([1], timeout=10)
                assert scope.cancelled_caught
                await root.wait_until_left([1], timeout=0.05)  # a timeout never raises
            with anyio.fail_after(5):  # returns at once, not at its timeout: rank 1 has left
                await root.wait_until_left([1], timeout=60)


async def test_in_process_the_root_does_not_wait_for_a_follower_to_leave() -> None:
    """The in-process followers are tasks of the root's process (their channels may close
    only after the root returns): no exit order to keep, so no wait."""
    send, receive = anyio.create_memory_object_stream[Command](10)
    with anyio.fail_after(20):
        async with open_root("memory", 2) as (root, follower):
            await root.publish_clique_id(clique_id(2))
            async with follower(1) as channel, receive:
                await channel.join(send)
                with anyio.fail_after(5):  # not the 60 s of its timeout
                    await root.wait_until_left([1], timeout=60)


async def test_report_failure_surfaces_as_rank_failed(impl: str) -> None:
    send, receive = anyio.create_memory_object_stream[Command](10)
    with anyio.fail_after(20):
        async with open_root(impl, 3) as (root, follower):
            await root.publish_clique_id(clique_id(3))
            channel = follower(2)
            async with channel, receive:
                await channel.join(send)
                await channel.report_failure("train", "CUDA out of memory")
                with pytest.raises(lampdist.RankFailed) as watched:
                    await root.watch()
                assert (watched.value.rank, watched.value.phase) == (2, "train")
                assert "CUDA out of memory" in str(watched.value)
                with pytest.raises(lampdist.RankFailed):
                    await root.broadcast(SEQUENCE[0])


async def test_cancelling_the_root_releases_everything(impl: str) -> None:
    send, receive = anyio.create_memory_object_stream[Command](10)
    with anyio.fail_after(20):
        async with root_in_task(impl, 3) as handle:
            root, channel = handle.root, handle.follower(1)
            async with channel, receive:
                await root.publish_clique_id(clique_id(3))
                await channel.join(send)
                with anyio.move_on_after(0.1) as scope:
                    await root.wait_for_peers(2, timeout=None)  # rank 2 never comes
                assert scope.cancelled_caught
                with anyio.move_on_after(0.1) as scope:
                    await root.watch()
                assert scope.cancelled_caught
                await handle.close()
                with pytest.raises(lampdist.PeerDisconnected):
                    await channel.watch()
                assert [command async for command in receive] == []


async def test_cancelling_a_join_releases_the_follower(impl: str) -> None:
    send, receive = anyio.create_memory_object_stream[Command](10)
    with anyio.fail_after(20):
        async with open_root(impl, 2) as (root, follower):
            channel = follower(1)
            async with channel, receive:
                with anyio.move_on_after(0.3) as scope:
                    await channel.join(send)  # no clique id is ever published
                assert scope.cancelled_caught
            # the follower registered, then left without STOP
            with pytest.raises(lampdist.PeerDisconnected) as watched:
                await root.watch()
            assert (watched.value.rank, watched.value.phase) == (1, "join")
            with pytest.raises(anyio.ClosedResourceError):
                send.send_nowait(SEQUENCE[0])  # the channel closed the command stream


async def test_wait_for_peers_names_the_missing_ranks(impl: str) -> None:
    run = FollowerRun()
    with anyio.fail_after(20):
        async with open_root(impl, 4) as (root, follower), anyio.create_task_group() as tg:
            await root.publish_clique_id(clique_id(4))
            tg.start_soon(run_follower, follower(2), run)
            await run.joined.wait()
            with pytest.raises(lampdist.JoinTimeout) as timeout:
                await root.wait_for_peers(3, timeout=0.2)
            assert isinstance(timeout.value, TimeoutError)
            assert (timeout.value.rank, timeout.value.phase) == (0, "join")
            assert "[1, 3]" in str(timeout.value)
            await root.broadcast(SEQUENCE[-1])


async def test_join_times_out_without_a_clique_id(impl: str) -> None:
    send, _receive = anyio.create_memory_object_stream[Command](10)
    with anyio.fail_after(20):
        async with open_root(impl, 2) as (_root, follower):
            async with follower(1) as channel:
                with pytest.raises(lampdist.JoinTimeout) as timeout:
                    await channel.join(send, timeout=0.2)
            assert (timeout.value.rank, timeout.value.phase) == (1, "join")
            assert "clique id" in str(timeout.value)
    _receive.close()


async def test_join_is_rejected_when_the_root_closes_first(impl: str) -> None:
    send, receive = anyio.create_memory_object_stream[Command](10)
    with anyio.fail_after(20):
        async with root_in_task(impl, 2) as handle:
            channel = handle.follower(1)
            async with channel, receive, anyio.create_task_group() as tg:
                tg.start_soon(_close_when_joined, handle)
                with pytest.raises(lampdist.JoinRejected) as rejected:
                    await channel.join(send)
                assert rejected.value.rank == 1


async def _close_when_joined(handle: RootHandle) -> None:
    await handle.root.wait_for_peers(1, timeout=10)
    await handle.close()


async def test_misuse_is_refused_with_clear_errors(impl: str) -> None:
    with anyio.fail_after(20):
        async with open_root(impl, 2) as (root, _follower):
            with pytest.raises(lampdist.ControlError, match="publish the clique id"):
                await root.broadcast(SEQUENCE[0])
            with pytest.raises(lampdist.MismatchError):
                await root.publish_clique_id(clique_id(3))
            await root.publish_clique_id(clique_id(2))
            with pytest.raises(lampdist.ConfigError, match="different clique id"):
                await root.publish_clique_id(clique_id(2))
            with pytest.raises(lampdist.ConfigError):
                await root.wait_for_peers(2, timeout=0)
            with pytest.raises(lampdist.ConfigError):
                await root.broadcast(SEQUENCE[0], timeout=-1)
            await root.broadcast(SEQUENCE[-1])
            with pytest.raises(lampdist.ControlError, match="STOP was already broadcast"):
                await root.broadcast(SEQUENCE[-1])


async def test_an_error_of_the_block_leaves_every_channel_unwrapped() -> None:
    """``async with channel:`` lets the block's own error out as it is, never inside an
    exception group of the channel's tasks (an entry point's error names rank and phase)."""
    root, (follower,) = control.local_channels(2)
    channels: list[Any] = [
        root,
        follower,
        control.tcp_root("127.0.0.1", 0, nranks=2, secret=SECRET),
        control.tcp_follower("127.0.0.1", 1, rank=1, secret=SECRET),
    ]
    for channel in channels:
        with pytest.raises(KeyError, match="the block's own"):
            async with channel:
                raise KeyError("the block's own")
