"""Only holders of the secret take part: what the TCP control channel authenticates, where it
listens, TLS over a whole training run, floods and scans of its port, that the secret shows
in no text, and (documented, not fixed) what the clique exposes.

tests/control/test_tcp.py covers the channel alone: a missing secret, a wrong one, garbage,
TLS refusals; tests/control/test_admission.py its bounds before authentication. These tests
add a real training run around it. See docs/threat-model.md.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import re
import resource
import socket
import ssl
import sys
import time
import traceback
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import trustme
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream
from cryptography.hazmat.primitives import serialization

import lampdist
from lampdist import checkpoint, control
from lampdist._checkpoint._object_store import StoreFiles
from lampdist._checkpoint._shards import ShardedState
from lampdist._checkpoint._store_client import open_store
from lampdist.clique import serve_rendezvous
from lampdist.control import Command
from lampdist.control import _admission as admission
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


# -- floods and scans of the control port -------------------------------------------------------

FLOOD = Path(__file__).parents[1] / "control" / "_flood.py"
"""Opens connections from a process of its own (see its docstring)."""
FLOOD_CONNECTIONS = 1100
SCAN_CONNECTIONS = 10_000

_unflooded: list[tuple[lampdist.LoopState, float]] = []


async def unflooded_run() -> tuple[lampdist.LoopState, float]:
    """The run without a flood, and its time in seconds (once per process)."""
    if not _unflooded:
        for _ in range(2):  # the first run of a process warms up (Gloo, the model)
            started = time.monotonic()
            async with root_channel() as root:
                state = await train_over_tcp(root, follower_of(root))
            seconds = time.monotonic() - started
        _unflooded.append((state, seconds))
    return _unflooded[0]


def control_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.levelno >= logging.WARNING and record.name.startswith("lampdist.control")
    ]


def refusals_told(lines: list[str]) -> int:
    """How many refusals the lines account for: one per line, the count of a line that
    counts those held back."""
    return sum(
        int(held.group(1)) if (held := re.search(r"(?:^| )(\d+) more ", line)) else 1
        for line in lines
    )


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@contextlib.contextmanager
def descriptor_limit(soft: int) -> Iterator[None]:
    """This process's soft RLIMIT_NOFILE lowered to ``soft`` (a common default) meanwhile."""
    old, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (old, hard))


async def ask(flood: Process, lines: BufferedByteReceiveStream, question: str) -> str:
    assert flood.stdin is not None
    await flood.stdin.send(question.encode() + b"\n")
    with anyio.fail_after(30):
        return (await lines.receive_until(b"\n", 100)).decode()


async def test_a_flood_of_idle_connections_leaves_the_run_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reference, plain_seconds = await unflooded_run()
    caplog.set_level(logging.WARNING, logger="lampdist.control")
    per_host = admission.MAX_UNAUTHENTICATED_PER_HOST + 1  # all from 127.0.0.1; 1 follower
    held: list[int] = []  # descriptors the root process holds beyond its own, while flooded
    with descriptor_limit(1024):
        assert open_descriptors() < 1024 - 2 * per_host
        started = time.monotonic()
        async with root_channel() as root:
            command = [sys.executable, str(FLOOD), "hold", str(FLOOD_CONNECTIONS)]
            async with await anyio.open_process([*command, *map(str, root.address)]) as flood:
                assert flood.stdout is not None
                lines = BufferedByteReceiveStream(flood.stdout)

                async def during() -> None:
                    before = open_descriptors()
                    assert await ask(flood, lines, "go") == f"connected {FLOOD_CONNECTIONS}"
                    closed = 0
                    with anyio.fail_after(30):
                        while closed < FLOOD_CONNECTIONS - per_host:  # the root closes those
                            held.append(open_descriptors() - before)
                            closed = int((await ask(flood, lines, "count")).split()[1])
                    held.append(open_descriptors() - before)

                state = await train_over_tcp(root, follower_of(root), during=during)
                assert flood.stdin is not None
                await flood.stdin.aclose()  # the flood closes its connections and ends
        flooded_seconds = time.monotonic() - started
    lines_logged = control_warnings(caplog)
    print(
        f"\nflood of {FLOOD_CONNECTIONS} idle connections at RLIMIT_NOFILE 1024: run "
        f"{flooded_seconds:.2f} s (without: {plain_seconds:.2f} s), {len(lines_logged)} "
        f"WARNING lines, at most {max(held)} descriptors held for the flood:\n"
        + "\n".join(lines_logged)
    )
    assert state == reference
    assert max(held) <= per_host + 4  # the handshakes let in, not the flood
    assert len(lines_logged) < 10
    # Each connection over the bound is told of; those let in, if they ended before the run.
    assert FLOOD_CONNECTIONS - per_host <= refusals_told(lines_logged) <= FLOOD_CONNECTIONS


async def refused_in_turn(root: control.TcpRootChannel) -> None:
    """Connect, speak HTTP and wait to be refused: the root accepts in order, so every
    connection made before this one has been taken in by then."""
    with anyio.fail_after(30):
        async with await anyio.connect_tcp(*root.address) as probe:
            await probe.send(b"GET / HTTP/1.1\r\n\r\n")
            with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                while True:
                    await probe.receive()


async def test_a_port_scan_leaves_the_run_alone(caplog: pytest.LogCaptureFixture) -> None:
    reference, plain_seconds = await unflooded_run()
    caplog.set_level(logging.WARNING, logger="lampdist.control")
    scanned: list[str] = []
    started = time.monotonic()
    async with root_channel() as root:

        async def during() -> None:
            command = [sys.executable, str(FLOOD), "scan", str(SCAN_CONNECTIONS)]
            with anyio.fail_after(90):  # the scan gives up after 60 s
                done = await anyio.run_process([*command, *map(str, root.address)])
            scanned.append(done.stdout.decode().strip())
            await refused_in_turn(root)  # so the root has taken in every scanned one

        state = await train_over_tcp(root, follower_of(root), during=during)
    scan_seconds = time.monotonic() - started
    lines_logged = control_warnings(caplog)
    print(
        f"\nscan of {SCAN_CONNECTIONS} connections: run {scan_seconds:.2f} s (without: "
        f"{plain_seconds:.2f} s), {len(lines_logged)} WARNING lines:\n" + "\n".join(lines_logged)
    )
    assert scanned == [f"scanned {SCAN_CONNECTIONS}"]
    assert state == reference
    assert len(lines_logged) < 10
    broken = [line for line in lines_logged if "broke in the handshake" in line]
    assert refusals_told(broken) == SCAN_CONNECTIONS


# -- the secret shows in no text ----------------------------------------------------------------

TELLTALE = "s3cr3t-XYZ-123"
"""A secret easy to find in any text."""


def forms_of(secret: str) -> list[str]:
    """``secret`` as text, and its bytes as repr, hex and base64 would show them."""
    raw = secret.encode()
    encoded = [base64.b64encode(raw), base64.urlsafe_b64encode(raw), base64.b32encode(raw)]
    return [
        secret,
        repr(raw),
        raw.hex(),
        raw.hex().upper(),
        *(form.decode().rstrip("=") for form in encoded),
    ]


def assert_secret_not_in(texts: list[str], secret: str = TELLTALE) -> None:
    for text in texts:
        for form in forms_of(secret):
            assert form not in text, f"{form!r} in {text[:300]!r}"


def tls_with_a_password(tmp_path: Path) -> ssl.SSLContext:
    """A server context whose key file is encrypted with the telltale as password."""
    leaf = trustme.CA().issue_cert("127.0.0.1")
    key = serialization.load_pem_private_key(leaf.private_key_pem.bytes(), password=None)
    encrypted = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(TELLTALE.encode()),
    )
    (tmp_path / "key.pem").write_bytes(encrypted)
    leaf.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem", password=TELLTALE)
    return context


def objects_holding_the_secret(tmp_path: Path) -> list[object]:
    """Every public object that holds a control secret, a TLS password or store credentials."""
    secret_file = tmp_path / "secret"
    secret_file.write_text(TELLTALE + "\n")
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    credentials = {"aws_access_key_id": TELLTALE, "aws_secret_access_key": TELLTALE}
    objects: list[object] = []
    for secret in (TELLTALE, TELLTALE.encode()):
        objects += [
            control.tcp_root(nranks=2, secret=secret),
            control.tcp_follower("127.0.0.1", 29501, rank=1, secret=secret),
            lampdist.launch.LaunchEnv(rank=0, nranks=2, secret=secret),
        ]
    env = lampdist.launch.from_env({**torchrun, "LAMPDIST_SECRET": TELLTALE})
    objects += [
        env,
        env.open_control(),
        lampdist.launch.from_env({**torchrun, "LAMPDIST_SECRET_FILE": str(secret_file)}),
        control.tcp_root(nranks=2, secret=TELLTALE, ssl_context=tls_with_a_password(tmp_path)),
        checkpoint.to_url("s3://bucket/run", options=credentials),
        checkpoint.to_url("s3://bucket/run", options=credentials, asynchronous=True),
        ShardedState(path="s3://bucket/run/epoch-000001/shards", nranks=2, options=credentials),
        StoreFiles(
            store=open_store("s3://bucket/run", credentials),
            url="s3://bucket/run",
            checkpoint="epoch-000001",
        ),
    ]
    return objects


def test_no_object_shows_the_secret_in_its_repr(tmp_path: Path) -> None:
    objects = objects_holding_the_secret(tmp_path)
    assert_secret_not_in([repr(each) for each in objects] + [str(each) for each in objects])


async def test_a_training_run_logs_no_secret(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    texts: list[str] = []
    async with control.tcp_root(nranks=2, secret=TELLTALE) as root:
        follower = control.tcp_follower(*root.address, rank=1, secret=TELLTALE, join_timeout=10)

        async def during() -> None:
            texts.extend([repr(root), str(root), repr(follower), str(follower)])  # joined

        state = await train_over_tcp(root, follower, during=during)
    assert state.epoch == _training.EPOCHS
    assert len(texts) == 4
    assert caplog.records
    for record in caplog.records:
        texts.append(record.getMessage())
        if record.exc_info:
            texts.append("".join(traceback.format_exception(*record.exc_info)))
    assert_secret_not_in(texts)


def error_texts(error: BaseException) -> list[str]:
    """What a user may print of ``error``: its str, repr and traceback, and those of its
    causes and contexts."""
    texts = ["".join(traceback.format_exception(error))]
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        each = todo.pop()
        if each is None or id(each) in seen:
            continue
        seen.add(id(each))
        texts += [str(each), repr(each), *getattr(each, "__notes__", [])]
        todo += [each.__cause__, each.__context__]
    return texts


async def test_a_wrong_secret_shows_in_no_error_nor_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = "wr0ng-ABC-789"
    send, receive = anyio.create_memory_object_stream[Command](10)
    with anyio.fail_after(20):
        async with control.tcp_root(nranks=2, secret=TELLTALE) as root:
            bad = control.tcp_follower(*root.address, rank=1, secret=wrong, join_timeout=10)
            async with bad, receive:
                with pytest.raises(lampdist.AuthenticationError) as refused:
                    await bad.join(send)
            with pytest.raises(lampdist.JoinTimeout) as timeout:
                await root.wait_for_peers(1, timeout=0.2)
    assert "authentication failed for rank 1" in str(timeout.value)
    texts = error_texts(refused.value) + error_texts(timeout.value)
    texts += [record.getMessage() for record in caplog.records]
    for secret in (TELLTALE, wrong):
        assert_secret_not_in(texts, secret)
