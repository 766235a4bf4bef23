"""TCP-only behaviour: authentication, TLS, bad peers, retries and heartbeats, on 127.0.0.1."""

from __future__ import annotations

import json
import logging
import re
import ssl
import struct
from typing import TypedDict

import anyio
import pytest
import trustme
from anyio.abc import SocketStream, TaskStatus

import lampdist
from lampdist import control
from lampdist.control import Command, CommandKind, TcpRootChannel
from lampdist.control import _bookkeeping as control_bookkeeping
from lampdist.control._auth import make_proof, new_nonce
from lampdist.control._command import MAX_TEXT_CHARS
from lampdist.control._wire import (
    Auth,
    Challenge,
    CliqueMessage,
    FrameDecoder,
    FramedStream,
    Hello,
    Message,
    Ping,
    Reject,
    Welcome,
    encode_frame,
)

from ._support import SECRET, SEQUENCE, FollowerRun, clique_id, free_port, run_follower

pytestmark = pytest.mark.anyio


class Heartbeats(TypedDict):
    heartbeat_interval: float
    heartbeat_timeout: float


FAST: Heartbeats = {"heartbeat_interval": 0.1, "heartbeat_timeout": 3.0}
FAKE_CLIQUE = clique_id(2)


def follower_of(
    root: TcpRootChannel,
    rank: int,
    *,
    secret: str = SECRET,
    join_timeout: float = 10.0,
    ssl_context: ssl.SSLContext | None = None,
    heartbeat_interval: float = FAST["heartbeat_interval"],
    heartbeat_timeout: float = FAST["heartbeat_timeout"],
) -> control.TcpFollowerChannel:
    host, port = root.address
    return control.tcp_follower(
        host,
        port,
        rank=rank,
        secret=secret,
        join_timeout=join_timeout,
        ssl_context=ssl_context,
        heartbeat_interval=heartbeat_interval,
        heartbeat_timeout=heartbeat_timeout,
    )


async def read_until_closed(stream: SocketStream) -> list[Message]:
    """Everything the peer sends until it closes, as messages."""
    decoder, messages = FrameDecoder(), []
    with anyio.fail_after(10):
        while True:
            try:
                messages.extend(decoder.feed(await stream.receive()))
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return messages


def warnings_in(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


# -- configuration ---------------------------------------------------------------------------


def test_a_secret_is_required_unless_insecure() -> None:
    with pytest.raises(lampdist.ConfigError, match="shared secret"):
        control.tcp_root(nranks=2, secret=None)
    with pytest.raises(lampdist.ConfigError, match="shared secret"):
        control.tcp_follower("127.0.0.1", 1, rank=1, secret=None)
    with pytest.raises(lampdist.ConfigError, match="non-empty"):
        control.tcp_root(nranks=2, secret="")
    with pytest.raises(lampdist.ConfigError, match="heartbeat_interval"):
        control.tcp_root(nranks=2, secret=SECRET, heartbeat_interval=5, heartbeat_timeout=5)
    with pytest.raises(lampdist.ConfigError, match="max_frame_bytes"):
        control.tcp_root(nranks=2, secret=SECRET, max_frame_bytes=10)
    with pytest.raises(lampdist.ConfigError, match="nranks"):
        control.tcp_root(nranks=0, secret=SECRET)
    with pytest.raises(lampdist.ConfigError, match="rank"):
        control.tcp_follower("127.0.0.1", 1, rank=-1, secret=SECRET)


async def test_insecure_mode_works_without_a_secret() -> None:
    run = FollowerRun()
    with anyio.fail_after(20):
        async with control.tcp_root(nranks=2, secret=None, insecure=True, **FAST) as root:
            host, port = root.address
            follower = control.tcp_follower(host, port, rank=1, secret=None, insecure=True)
            async with anyio.create_task_group() as tg:
                await root.publish_clique_id(clique_id(2))
                tg.start_soon(run_follower, follower, run)
                await root.wait_for_peers(1, timeout=10)
                await root.broadcast(SEQUENCE[-1])
    assert run.commands == [SEQUENCE[-1]]


async def test_the_root_binds_loopback_and_reports_its_port() -> None:
    async with control.tcp_root(nranks=2, secret=SECRET) as root:
        host, port = root.address
        assert host == "127.0.0.1"
        assert port > 0
    with pytest.raises(OSError, match=r"(?i)refused|failed"):  # the port is released on exit
        await anyio.connect_tcp(host, port)


# -- a legitimate follower carries on beside bad peers ---------------------------------------


async def _legit(root: TcpRootChannel, run: FollowerRun, *, task_status: TaskStatus[None]) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(run_follower, follower_of(root, 1), run)
        await run.joined.wait()
        task_status.started()


async def _finish(root: TcpRootChannel, run: FollowerRun) -> None:
    """The legitimate follower still gets every command, and no follower failed."""
    for command in SEQUENCE:
        await root.broadcast(command)
    with anyio.fail_after(10):
        while not run.ended:  # noqa: ASYNC110  # the follower drains its commands
            await anyio.sleep(0.01)
    assert run.commands == SEQUENCE


def raw_frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


GARBAGE = {
    "http": b"GET / HTTP/1.1\r\nHost: root\r\n\r\n",
    "oversize": struct.pack(">I", control.DEFAULT_MAX_FRAME_BYTES + 1) + b"x" * 100,
    "not-json": struct.pack(">I", 8) + b"\xff\xfe{}[]\x00\x01",
    "wrong-version": raw_frame(json.dumps({"v": 99, "t": "hello"}).encode()),
    "no-hello": encode_frame(Ping()),
    "silent": b"",
}


@pytest.mark.parametrize("kind", sorted(GARBAGE))
async def test_bad_input_is_refused_and_does_not_disturb_followers(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="lampdist.control")
    run = FollowerRun()
    with anyio.fail_after(20):
        async with (
            control.tcp_root(nranks=2, secret=SECRET, handshake_timeout=0.5, **FAST) as root,
            anyio.create_task_group() as tg,
        ):
            await root.publish_clique_id(clique_id(2))
            await tg.start(_legit, root, run)
            async with await anyio.connect_tcp(*root.address) as raw:
                if GARBAGE[kind]:
                    await raw.send(GARBAGE[kind])
                answer = await read_until_closed(raw)
            assert len(answer) == 1
            assert isinstance(answer[0], Reject)
            assert answer[0].code == "protocol"
            await _finish(root, run)
    expected = {"silent": "no complete handshake", "wrong-version": "version 99"}
    assert expected.get(kind, "refused") in warnings_in(caplog)


async def test_a_joined_follower_sending_garbage_is_dropped_and_named() -> None:
    with anyio.fail_after(20):
        async with control.tcp_root(nranks=3, secret=SECRET, **FAST) as root:
            await root.publish_clique_id(clique_id(3))
            framed = await raw_join(root, rank=2)
            await framed.stream.send(b"\x00\x00\x00\x03abc")
            with pytest.raises(lampdist.PeerDisconnected, match="bad frame") as watched:
                await root.watch()
            assert watched.value.rank == 2
            await framed.aclose()


@pytest.mark.parametrize(
    ("rank", "reason"), [(1, "already joined"), (3, "out of range"), (0, "out of range")]
)
async def test_rejected_joins_fail_at_once_with_the_reason(rank: int, reason: str) -> None:
    run = FollowerRun()
    send, receive = anyio.create_memory_object_stream[Command](10)
    with anyio.fail_after(20):
        async with control.tcp_root(nranks=3, secret=SECRET, **FAST) as root:
            await root.publish_clique_id(clique_id(3))
            async with anyio.create_task_group() as tg:
                await tg.start(_legit, root, run)
                async with follower_of(root, rank, join_timeout=60) as intruder, receive:
                    with pytest.raises(lampdist.JoinRejected, match=reason) as rejected:
                        await intruder.join(send)
                assert (rejected.value.rank, rejected.value.phase) == (rank, "join")
                await root.wait_for_peers(1, timeout=0)
                await _finish(root, run)


async def test_wrong_secret_fails_at_once_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="lampdist.control")
    run = FollowerRun()
    send, receive = anyio.create_memory_object_stream[Command](10)
    with anyio.fail_after(20):
        async with control.tcp_root(nranks=3, secret=SECRET, **FAST) as root:
            await root.publish_clique_id(clique_id(3))
            async with anyio.create_task_group() as tg:
                await tg.start(_legit, root, run)
                async with follower_of(root, 2, secret="guess", join_timeout=60) as bad, receive:
                    with pytest.raises(lampdist.AuthenticationError) as refused:
                        await bad.join(send)
                assert refused.value.rank == 2
                await _finish(root, run)
    assert "authentication failed for rank 2" in warnings_in(caplog)


async def test_mismatched_heartbeats_are_refused() -> None:
    send, receive = anyio.create_memory_object_stream[Command](10)
    with anyio.fail_after(20):
        async with control.tcp_root(nranks=2, secret=SECRET, **FAST) as root:
            slow = follower_of(root, 1, heartbeat_interval=4.0, heartbeat_timeout=20.0)
            async with slow, receive:
                with pytest.raises(lampdist.MismatchError, match="heartbeat_interval"):
                    await slow.join(send)


# -- a fake root, to check what the follower checks -----------------------------------------


async def _fake_root(proof_ok: bool, *, task_status: TaskStatus[int]) -> None:
    """Accepts one follower, answers its handshake (with a valid proof or not), publishes a
    clique id, then falls silent without closing."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with listener:
        task_status.started(listener.extra(anyio.abc.SocketAttribute.local_port))
        [socket_listener] = listener.listeners
        assert isinstance(socket_listener, anyio.abc.SocketListener)
        stream = await socket_listener.accept()
        async with stream:
            framed = FramedStream(stream)
            hello = await framed.receive()
            assert isinstance(hello, Hello)
            nonce = new_nonce()
            await framed.send(Challenge(nonce=nonce))
            await framed.receive()
            key = SECRET.encode() if proof_ok else b"not the secret"
            proof = make_proof(key, "root", rank=1, follower_nonce=hello.nonce, root_nonce=nonce)
            await framed.send(Welcome(proof=proof, heartbeat_interval=0.1))
            await framed.send(CliqueMessage(clique_id=FAKE_CLIQUE))
            await anyio.sleep_forever()


async def test_the_follower_authenticates_the_root() -> None:
    send, receive = anyio.create_memory_object_stream[Command](10)
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            port = await tg.start(_fake_root, False)
            follower = control.tcp_follower("127.0.0.1", port, rank=1, secret=SECRET)
            async with follower, receive:
                with pytest.raises(lampdist.AuthenticationError, match="root failed"):
                    await follower.join(send)
            tg.cancel_scope.cancel()


async def _mute_root(*, task_status: TaskStatus[int]) -> None:
    """Accepts connections and never says a word."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with listener:
        task_status.started(listener.extra(anyio.abc.SocketAttribute.local_port))
        await listener.serve(_silent)


async def _silent(stream: SocketStream) -> None:
    async with stream:
        await anyio.sleep_forever()


async def test_a_mute_root_fails_the_handshake_with_a_timeout() -> None:
    send, receive = anyio.create_memory_object_stream[Command](10)
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            port = await tg.start(_mute_root)
            follower = control.tcp_follower(
                "127.0.0.1", port, rank=1, secret=SECRET, handshake_timeout=0.3
            )
            async with follower, receive:
                with pytest.raises(lampdist.JoinTimeout, match="handshake") as timeout:
                    await follower.join(send)
            assert (timeout.value.rank, timeout.value.phase) == (1, "handshake")
            tg.cancel_scope.cancel()


async def test_the_follower_notices_a_silent_root() -> None:
    send, receive = anyio.create_memory_object_stream[Command](10)
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            port = await tg.start(_fake_root, True)
            follower = control.tcp_follower(
                "127.0.0.1",
                port,
                rank=1,
                secret=SECRET,
                heartbeat_interval=0.1,
                heartbeat_timeout=0.5,
            )
            async with follower, receive:
                assert await follower.join(send) == FAKE_CLIQUE
                with pytest.raises(lampdist.PeerDisconnected, match="heartbeat") as watched:
                    await follower.watch()
                assert watched.value.rank == 0
                assert [command async for command in receive] == []  # the stream ends
            tg.cancel_scope.cancel()


# -- a fake follower, to check what the root checks ------------------------------------------


async def raw_join(root: TcpRootChannel, *, rank: int) -> FramedStream:
    """Join ``root`` by hand, speaking the wire protocol directly."""
    framed = FramedStream(await anyio.connect_tcp(*root.address))
    nonce = new_nonce()
    await framed.send(Hello(rank=rank, nonce=nonce, heartbeat_interval=0.1))
    challenge = await framed.receive()
    assert isinstance(challenge, Challenge)
    proof = make_proof(
        SECRET.encode(), "follower", rank=rank, follower_nonce=nonce, root_nonce=challenge.nonce
    )
    await framed.send(Auth(proof=proof))
    assert isinstance(await framed.receive(), Welcome)
    return framed


async def test_the_root_notices_a_silent_follower() -> None:
    with anyio.fail_after(20):
        async with control.tcp_root(
            nranks=3, secret=SECRET, heartbeat_interval=0.1, heartbeat_timeout=0.5
        ) as root:
            await root.publish_clique_id(clique_id(3))
            framed = await raw_join(root, rank=2)  # joins, then never answers
            with pytest.raises(lampdist.PeerDisconnected, match="heartbeat") as watched:
                await root.watch()
            assert watched.value.rank == 2
            with pytest.raises(lampdist.PeerDisconnected) as broadcast:
                await root.broadcast(SEQUENCE[0])
            assert broadcast.value.rank == 2
            await framed.aclose()


async def test_a_follower_that_never_acknowledges_times_the_broadcast_out() -> None:
    with anyio.fail_after(20):
        async with control.tcp_root(nranks=2, secret=SECRET, **FAST) as root:
            await root.publish_clique_id(clique_id(2))
            framed = await raw_join(root, rank=1)
            async with anyio.create_task_group() as tg:
                tg.start_soon(_keep_pinging, framed)  # alive, but ignores commands
                with pytest.raises(lampdist.LampdistTimeout) as timeout:
                    await root.broadcast(SEQUENCE[0], timeout=0.3)
                assert isinstance(timeout.value, TimeoutError)
                assert (timeout.value.rank, timeout.value.phase) == (1, "broadcast")
                tg.cancel_scope.cancel()
            await framed.aclose()


async def _keep_pinging(framed: FramedStream) -> None:
    while True:
        await framed.send(Ping())
        await anyio.sleep(0.05)


# -- retries and timeouts --------------------------------------------------------------------


async def test_a_follower_started_before_the_root_retries_until_it_listens() -> None:
    port = free_port()
    run = FollowerRun()
    follower = control.tcp_follower("127.0.0.1", port, rank=1, secret=SECRET, join_timeout=20)
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_follower, follower, run)
            await anyio.sleep(0.3)  # a few refused connections
            async with control.tcp_root(port=port, nranks=2, secret=SECRET, **FAST) as root:
                await root.publish_clique_id(clique_id(2))
                await root.wait_for_peers(1, timeout=10)
                await root.broadcast(SEQUENCE[-1])
    assert run.commands == [SEQUENCE[-1]]


async def test_join_times_out_when_no_root_listens() -> None:
    send, receive = anyio.create_memory_object_stream[Command](10)
    follower = control.tcp_follower("127.0.0.1", free_port(), rank=1, secret=SECRET)
    with anyio.fail_after(20):
        async with follower, receive:
            with pytest.raises(lampdist.JoinTimeout, match="could not connect") as timeout:
                await follower.join(send, timeout=0.3)
    assert isinstance(timeout.value, TimeoutError)
    assert (timeout.value.rank, timeout.value.phase) == (1, "join")


async def test_long_errors_are_cut_to_fit_a_frame() -> None:
    run = FollowerRun()
    stop = Command(kind=CommandKind.STOP, epoch=0, pass_index=0, error="x" * 100_000)
    with anyio.fail_after(20):
        async with control.tcp_root(nranks=2, secret=SECRET, **FAST) as root:
            await root.publish_clique_id(clique_id(2))
            async with anyio.create_task_group() as tg:
                tg.start_soon(run_follower, follower_of(root, 1), run)
                await root.wait_for_peers(1, timeout=10)
                await root.broadcast(stop)
    [received] = run.commands
    assert received.error is not None
    assert len(received.error) == MAX_TEXT_CHARS
    assert received.error.endswith("[cut]")


# -- TLS -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls() -> dict[str, ssl.SSLContext]:
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server)
    client = ssl.create_default_context()
    ca.configure_trust(client)
    stranger = ssl.create_default_context()
    trustme.CA().configure_trust(stranger)
    return {"server": server, "client": client, "stranger": stranger}


async def test_tls_carries_the_whole_run(tls: dict[str, ssl.SSLContext]) -> None:
    run = FollowerRun()
    with anyio.fail_after(20):
        async with (
            control.tcp_root(nranks=2, secret=SECRET, ssl_context=tls["server"], **FAST) as root,
            anyio.create_task_group() as tg,
        ):
            await root.publish_clique_id(clique_id(2))
            tg.start_soon(run_follower, follower_of(root, 1, ssl_context=tls["client"]), run)
            await root.wait_for_peers(1, timeout=10)
            for command in SEQUENCE:
                await root.broadcast(command)
    assert run.commands == SEQUENCE


@pytest.mark.parametrize(
    ("client", "error"),
    [("stranger", lampdist.AuthenticationError), (None, lampdist.JoinRejected)],
)
async def test_tls_refuses_untrusted_and_plain_peers(
    tls: dict[str, ssl.SSLContext],
    client: str | None,
    error: type[lampdist.LampdistError],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="lampdist.control")
    run = FollowerRun()
    send, receive = anyio.create_memory_object_stream[Command](10)
    with anyio.fail_after(20):
        async with (
            control.tcp_root(nranks=3, secret=SECRET, ssl_context=tls["server"], **FAST) as root,
            anyio.create_task_group() as tg,
        ):
            await root.publish_clique_id(clique_id(3))
            tg.start_soon(run_follower, follower_of(root, 1, ssl_context=tls["client"]), run)
            await run.joined.wait()
            context = tls[client] if client else None
            async with follower_of(root, 2, ssl_context=context, join_timeout=60) as bad, receive:
                with pytest.raises(error):
                    await bad.join(send)
            await _finish(root, run)
    assert "broke in the handshake" in warnings_in(caplog)


async def test_a_tls_follower_refuses_a_plain_root(tls: dict[str, ssl.SSLContext]) -> None:
    send, receive = anyio.create_memory_object_stream[Command](10)
    with anyio.fail_after(20):
        async with (
            control.tcp_root(nranks=2, secret=SECRET, **FAST) as root,
            follower_of(root, 1, ssl_context=tls["client"]) as follower,
            receive,
        ):
            with pytest.raises(lampdist.ControlError):
                await follower.join(send)


# -- long waits say what they see -------------------------------------------------------------


@pytest.fixture
def quick_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Progress lines of long waits after 0.2 s, then every 0.3 s (10 s and 20 s in use)."""
    monkeypatch.setattr(control_bookkeeping, "FIRST_REPORT", 0.2)
    monkeypatch.setattr(control_bookkeeping, "REPORT_EVERY", 0.3)


async def test_a_join_timeout_names_the_follower_that_was_refused() -> None:
    send, receive = anyio.create_memory_object_stream[Command](10)
    with anyio.fail_after(20):
        async with control.tcp_root(nranks=2, secret=SECRET, **FAST) as root:
            await root.publish_clique_id(clique_id(2))
            async with follower_of(root, 1, secret="guess", join_timeout=60) as bad, receive:
                with pytest.raises(lampdist.AuthenticationError):
                    await bad.join(send)
            with pytest.raises(lampdist.JoinTimeout) as timeout:
                await root.wait_for_peers(1, timeout=0.5)
    message = str(timeout.value)
    assert "0 of 1 followers joined; missing ranks [1]" in message
    assert "refused meanwhile: from 127.0.0.1:" in message
    assert "authentication failed for rank 1: its secret differs from the root's" in message


async def test_a_root_waiting_for_followers_reports_its_progress(
    caplog: pytest.LogCaptureFixture, quick_reports: None
) -> None:
    caplog.set_level(logging.WARNING, logger="lampdist.control")
    with anyio.fail_after(20):
        async with control.tcp_root(nranks=3, secret=SECRET, **FAST) as root:
            await root.publish_clique_id(clique_id(3))
            with pytest.raises(lampdist.JoinTimeout):
                await root.wait_for_peers(2, timeout=1.0)
    lines = [line for line in warnings_in(caplog).splitlines() if "waiting for followers" in line]
    assert len(lines) >= 2, lines
    assert "0 of 2 followers joined; missing ranks [1, 2]" in lines[0]
    assert re.search(r"\d+ s left of 1.0 s", lines[0])


async def test_a_follower_without_a_root_reports_its_retries(
    caplog: pytest.LogCaptureFixture, quick_reports: None
) -> None:
    caplog.set_level(logging.WARNING, logger="lampdist.control")
    port = free_port()  # nothing listens there
    send, receive = anyio.create_memory_object_stream[Command](10)
    with anyio.fail_after(20):
        async with (
            control.tcp_follower(
                "127.0.0.1", port, rank=1, secret=SECRET, join_timeout=1.0
            ) as follower,
            receive,
        ):
            with pytest.raises(lampdist.JoinTimeout, match="could not connect"):
                await follower.join(send)
    lines = [line for line in warnings_in(caplog).splitlines() if "no root listening" in line]
    assert len(lines) >= 2, lines
    assert f"rank 1: no root listening at 127.0.0.1:{port} yet (Connection refused)" in lines[0]
    assert re.search(r"retrying, \d+ s left of 1.0 s", lines[0])
