"""The lifecycle every control channel shares: entered once, used inside ``async with``,
closed through ``aclose``."""

from __future__ import annotations

import anyio
import pytest

import lampdist
from lampdist import control
from lampdist.control import Command
from lampdist.control._lifecycle import ChannelLifecycle

from ._support import SECRET, SEQUENCE, TCP_SETTINGS, clique_id, free_port, open_root

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["memory", "tcp"])
def impl(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _every_channel() -> list[ChannelLifecycle]:
    root, (follower,) = control.local_channels(2)
    channels = [
        root,
        follower,
        control.tcp_root("127.0.0.1", 0, nranks=2, secret=SECRET),
        control.tcp_follower("127.0.0.1", 1, rank=1, secret=SECRET),
    ]
    assert all(isinstance(channel, ChannelLifecycle) for channel in channels)
    return [channel for channel in channels if isinstance(channel, ChannelLifecycle)]


async def test_a_channel_is_entered_once_and_used_only_inside_async_with() -> None:
    for channel in _every_channel():
        with pytest.raises(lampdist.ControlError, match="is new: use it inside 'async with'"):
            channel._check_open("join")
        async with channel:
            channel._check_open("join")
        with pytest.raises(lampdist.ControlError, match="is closed: use it inside"):
            channel._check_open("join")
        with pytest.raises(lampdist.ControlError, match="entered only once") as refused:
            async with channel:
                pass
        assert refused.value.phase == "open"


async def test_aclose_closes_a_follower_as_leaving_its_block_does(impl: str) -> None:
    send, receive = anyio.create_memory_object_stream[Command](10)
    with anyio.fail_after(20):
        async with open_root(impl, 2) as (root, follower):
            channel = follower(1)
            assert isinstance(channel, ChannelLifecycle)
            await root.publish_clique_id(clique_id(2))
            async with channel, receive:
                await channel.join(send)
                await root.wait_for_peers(1, timeout=10)
                await channel.aclose()
                await channel.aclose()  # closed already: nothing more
                with pytest.raises(lampdist.ControlError, match="is closed"):
                    await channel.join(send)
                with pytest.raises(anyio.ClosedResourceError):
                    send.send_nowait(SEQUENCE[0])  # the channel closed the command stream
                with pytest.raises(lampdist.PeerDisconnected) as watched:
                    await root.watch()
                assert watched.value.rank == 1


async def test_aclose_of_the_root_tells_the_followers(impl: str) -> None:
    if impl == "memory":
        root, (channel,) = control.local_channels(2)
    else:
        port = free_port()
        root = control.tcp_root("127.0.0.1", port, nranks=2, secret=SECRET, **TCP_SETTINGS)
        channel = control.tcp_follower(
            "127.0.0.1", port, rank=1, secret=SECRET, join_timeout=10.0, **TCP_SETTINGS
        )
    assert isinstance(root, ChannelLifecycle)
    send, receive = anyio.create_memory_object_stream[Command](10)
    with anyio.fail_after(20):
        async with channel, receive:
            async with root:  # entered last, so that aclose() may end it inside its block
                await root.publish_clique_id(clique_id(2))
                await channel.join(send)
                await root.wait_for_peers(1, timeout=10)
                await root.aclose()
                with pytest.raises(lampdist.ControlError, match="is closed"):
                    await root.broadcast(SEQUENCE[0])
            with pytest.raises(lampdist.PeerDisconnected):
                await channel.watch()
