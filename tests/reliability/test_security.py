"""Only holders of the secret take part: what the TCP control channel authenticates, where it
listens, TLS over a whole training run, and (documented, not fixed) what the clique exposes.

tests/control/test_tcp.py covers the channel alone: a missing secret, a wrong one, garbage,
TLS refusals. These tests add a real training run around it. See docs/threat-model.md.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import trustme

import lampdist
from lampdist import control
from lampdist.clique import serve_rendezvous
from lampdist.control import Command
from lampdist.control._auth import make_proof, new_nonce
from lampdist.control._wire import Auth, Challenge, FramedStream, Hello, Reject

from . import _training
from . import rank as rank_script

SECRET = "the run's secret"
OTHER_LOOPBACK = "127.0.0.2"  # on Linux all of 127/8 is this machine, but not 127.0.0.1


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tls() -> dict[str, ssl.SSLContext]:
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server)
    client = ssl.create_default_context()
    ca.configure_trust(client)
    return {"server": server, "client": client}


def refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


async def train_over_tcp(
    root: control.TcpRootChannel,
    follower: control.TcpFollowerChannel,
    *,
    during: Any = None,
) -> lampdist.LoopState:
    """Two ranks of the reliability run over ``root`` and ``follower``; ``during()`` is awaited
    on the root after the first step, while the run holds still."""
    root_data, data = _training.entries(2)
    state: list[lampdist.LoopState] = []

    async def on_event(event: lampdist.PassEvent) -> None:
        if during is not None and event.epoch == 0 and event.step == 1:
            await during()

    async def drive() -> None:
        state.append(
            await lampdist.drive_distributed_training(
                data=root_data,
                nranks=2,
                device="cpu",
                control=root,
                optimizer_factory=rank_script.sgd,
                loop=lampdist.LoopOptions(max_epochs=_training.EPOCHS, on_event=on_event),
            )
        )

    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            group.start_soon(drive)
            async with follower:
                await lampdist.follow_distributed_training(
                    data=data,
                    rank=1,
                    nranks=2,
                    device="cpu",
                    control=follower,
                )
    return state[0]


@contextlib.asynccontextmanager
async def root_channel(**kwargs: Any) -> AsyncIterator[control.TcpRootChannel]:
    async with control.tcp_root(nranks=2, secret=SECRET, **kwargs) as root:
        yield root


def follower_of(root: control.TcpRootChannel, rank: int = 1, **kwargs: Any) -> Any:
    settings: dict[str, Any] = {"secret": SECRET, "join_timeout": 10.0, **kwargs}
    return control.tcp_follower(*root.address, rank=rank, **settings)


# -- where the channel listens ---------------------------------------------------------------


def test_no_secret_no_channel() -> None:
    for make in (
        lambda: control.tcp_root(nranks=2, secret=None),
        lambda: control.tcp_follower("127.0.0.1", 1, rank=1, secret=None),
    ):
        with pytest.raises(lampdist.ConfigError, match=r"secret=\.\.\..*insecure=True"):
            make()


async def test_the_root_listens_on_127_0_0_1_only_unless_given_a_host() -> None:
    async with control.tcp_root(nranks=2, secret=SECRET) as root:
        assert root.address[0] == "127.0.0.1"
        assert not refused("127.0.0.1", root.address[1])
        assert refused(OTHER_LOOPBACK, root.address[1])
    async with control.tcp_root("0.0.0.0", nranks=2, secret=SECRET) as root:
        assert not refused(OTHER_LOOPBACK, root.address[1])


async def test_the_rendezvous_store_listens_everywhere_as_documented() -> None:
    # docs/threat-model.md: torch's TCPStore is not bound to the rendezvous host and not
    # authenticated. If this fails, that was fixed: update the threat model.
    async with serve_rendezvous(nranks=2, host="127.0.0.1") as clique_id:
        assert not refused(OTHER_LOOPBACK, clique_id.port)


# -- who takes part ---------------------------------------------------------------------------


async def test_a_training_run_over_tls(tls: dict[str, ssl.SSLContext]) -> None:
    async with root_channel(ssl_context=tls["server"]) as root:
        state = await train_over_tcp(root, follower_of(root, ssl_context=tls["client"]))
    assert state.epoch == _training.EPOCHS


async def test_intruders_are_refused_and_the_run_goes_on() -> None:
    attempts: dict[str, BaseException] = {}

    async def intrude(name: str, channel: control.TcpFollowerChannel) -> None:
        send, receive = anyio.create_memory_object_stream[Command](10)
        async with channel, receive:
            try:
                await channel.join(send)
            except lampdist.ControlError as exc:
                attempts[name] = exc

    async with root_channel() as root:

        async def during() -> None:
            await intrude("wrong secret", follower_of(root, secret="guess"))
            await intrude("no secret", follower_of(root, secret=None, insecure=True))
            await intrude("a rank taken", follower_of(root))
            await intrude("a rank too many", follower_of(root, rank=2))

        state = await train_over_tcp(root, follower_of(root), during=during)
    assert state.epoch == _training.EPOCHS
    assert isinstance(attempts["wrong secret"], lampdist.AuthenticationError)
    assert isinstance(attempts["no secret"], lampdist.AuthenticationError)
    assert isinstance(attempts["a rank taken"], lampdist.JoinRejected)
    assert "already joined" in str(attempts["a rank taken"])
    assert isinstance(attempts["a rank too many"], lampdist.JoinRejected)


async def test_a_replayed_proof_is_refused() -> None:
    # An eavesdropper recorded a follower's hello and auth; the root's fresh nonce makes the
    # recorded proof worthless on a new connection.
    recorded_nonce, old_root_nonce = new_nonce(), new_nonce()
    proof = make_proof(
        SECRET.encode(),
        "follower",
        rank=1,
        follower_nonce=recorded_nonce,
        root_nonce=old_root_nonce,
    )
    with anyio.fail_after(10):
        async with root_channel() as root:
            stream = await anyio.connect_tcp(*root.address)
            framed = FramedStream(stream)
            async with stream:
                await framed.send(Hello(rank=1, nonce=recorded_nonce, heartbeat_interval=1.0))
                challenge = await framed.receive()
                assert isinstance(challenge, Challenge)
                assert challenge.nonce != old_root_nonce
                await framed.send(Auth(proof=proof))
                answer = await framed.receive()
            assert isinstance(answer, Reject)
            assert answer.code == "auth"
            assert await root.peers() == 0
