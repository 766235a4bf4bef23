"""The root side of the TCP control channel."""

from __future__ import annotations

import contextlib
import logging
import ssl
from collections.abc import Collection
from typing import NoReturn

import anyio
import anyio.lowlevel
import attrs
from anyio.abc import ByteStream, SocketAttribute, SocketListener, SocketStream, TaskGroup
from anyio.streams.stapled import MultiListener
from anyio.streams.tls import TLSStream

from .._clique_id import CliqueId
from .._errors import (
    ConfigError,
    ControlError,
    LampdistError,
    LampdistTimeout,
    PeerDisconnected,
    ProtocolError,
)
from ._admission import (
    FIRST_ACCEPT_RETRY_DELAY,
    MAX_ACCEPT_RETRY_DELAY,
    Admission,
    ThrottledWarnings,
    WarningKind,
    accept_retry_delay,
    os_error_of,
)
from ._auth import make_proof, new_nonce, secret_bytes, verify_proof
from ._bookkeeping import RootRegistry, copy_error
from ._command import Command, CommandKind
from ._lifecycle import ChannelLifecycle, aclose_shielded
from ._protocols import (
    DEFAULT_BROADCAST_TIMEOUT,
    USE_CHANNEL_DEFAULT,
    UseChannelDefault,
    resolve_timeout,
)
from ._settings import (
    DEFAULT_HANDSHAKE_TIMEOUT,
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_HEARTBEAT_TIMEOUT,
    TcpSettings,
    check_settings,
)
from ._tcp_session import AckRound, FollowerSession
from ._wire import (
    DEFAULT_MAX_FRAME_BYTES,
    Auth,
    Challenge,
    CliqueMessage,
    CommandMessage,
    FramedStream,
    Hello,
    Reject,
    RejectCode,
    Welcome,
    encode_frame,
)

__all__ = ["TcpRootChannel", "tcp_root"]

logger = logging.getLogger(__name__)

#: How long the root tries to tell a refused peer why (it may not listen).
_REJECT_TIMEOUT = 1.0
#: How often the counts of refusals held back are looked at (see ThrottledWarnings).
_FLUSH_EVERY = 1.0


class _Refused(Exception):
    """A handshake ends with a rejection frame."""

    def __init__(self, code: RejectCode, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason


@attrs.define(eq=False)
class TcpRootChannel(ChannelLifecycle):
    """The root side of the TCP control channel; see :class:`RootChannel` and
    :func:`tcp_root`."""

    nranks: int
    _host: str
    _port: int
    _key: bytes = attrs.field(repr=False)
    _settings: TcpSettings
    _broadcast_timeout: float | None
    _registry: RootRegistry = attrs.field(init=False)
    _admission: Admission = attrs.field(init=False)
    _warnings: ThrottledWarnings = attrs.field(init=False)
    _sessions: dict[int, FollowerSession] = attrs.field(factory=dict)
    _seq: int = 0
    _address: tuple[str, int] | None = None
    _listener: MultiListener[SocketStream] | None = None

    def __attrs_post_init__(self) -> None:
        self._registry = RootRegistry(nranks=self.nranks)
        self._admission = Admission.for_run(self.nranks)
        self._warnings = ThrottledWarnings(logger)

    @property
    def address(self) -> tuple[str, int]:
        """The ``(host, port)`` the root listens on (the port picked when given 0)."""
        if self._address is None:
            raise ControlError("the root is not listening yet: enter it first", rank=0)
        return self._address

    def _identity(self) -> tuple[str, int]:
        return "the root channel", 0

    async def _prepare(self) -> None:
        try:
            listener = await anyio.create_tcp_listener(local_host=self._host, local_port=self._port)
        except OSError as exc:
            raise ControlError(
                f"cannot listen on {self._host}:{self._port} ({exc})", rank=0, phase="open"
            ) from exc
        address = listener.listeners[0].extra(SocketAttribute.local_address)
        assert isinstance(address, tuple)  # an IP listener has a (host, port, ...) address
        self._address = (str(address[0]), int(address[1]))
        self._listener = listener

    def _start_tasks(self, task_group: TaskGroup) -> None:
        assert self._listener is not None  # set by _prepare
        task_group.start_soon(self._serve, self._listener)
        task_group.start_soon(self._flush_warnings)
        logger.info("control root listening on %s:%d", *self.address, extra={"rank": 0})

    def _closing(self) -> None:
        self._registry.closed = True
        self._registry.changed.notify()
        self._warnings.flush(every=True)

    async def _flush_warnings(self) -> None:
        while True:
            await anyio.sleep(min(_FLUSH_EVERY, self._warnings.interval))
            self._warnings.flush()

    async def _serve(self, listener: MultiListener[SocketStream]) -> None:
        async with listener, anyio.create_task_group() as group:
            for each in listener.listeners:
                assert isinstance(each, SocketListener)  # create_tcp_listener makes these
                group.start_soon(self._accept, each)

    async def _accept(self, listener: SocketListener) -> None:
        """Accept connections until the channel closes. Running out of descriptors or memory
        passes: ``accept`` is tried again after a wait that doubles up to
        :data:`MAX_ACCEPT_RETRY_DELAY`. Any other failure of the listener ends this loop and
        is raised by :meth:`watch` and :meth:`wait_for_peers` as a :class:`ControlError`."""
        backoff = FIRST_ACCEPT_RETRY_DELAY
        while True:
            try:
                raw = await listener.accept()
            except anyio.ClosedResourceError:
                return
            except (OSError, anyio.BrokenResourceError) as exc:
                error = os_error_of(exc)
                delay = None if error is None else accept_retry_delay(error, backoff)
                if delay is None:
                    self._stop_accepting(error or exc)
                    return
                self._warnings.warn(
                    "accept",
                    f"could not accept a control connection ({error}); retrying in "
                    f"{delay:.2f} s, followers that joined are not affected",
                )
                if delay:
                    await anyio.sleep(delay)
                    backoff = min(2 * backoff, MAX_ACCEPT_RETRY_DELAY)
                continue
            backoff = FIRST_ACCEPT_RETRY_DELAY
            await self._admit(raw)

    def _stop_accepting(self, error: BaseException) -> None:
        failure = ControlError(
            "the root's control listener on {}:{} failed ({!r}): no follower can join any "
            "more".format(*self.address, error),
            rank=0,
            phase=self._registry.phase,
        )
        logger.error("%s", failure, extra={"rank": 0})
        self._registry.channel_failed(failure)

    async def _admit(self, raw: SocketStream) -> None:
        """Give ``raw`` a handshake, or close it at once when too many connections are in
        their handshake already."""
        peer, host = _peer_name(raw)
        refusal = self._admission.enter(host)
        if refusal is None:
            assert self._task_group is not None  # the channel is open
            self._task_group.start_soon(self._handle_connection, raw, peer, host)
            return
        self._refuse(refusal.kind, peer, refusal.reason)
        await aclose_shielded(raw)

    def _refuse(self, kind: WarningKind, peer: str, reason: str) -> None:
        self._warnings.warn(kind, f"refused a control connection from {peer}: {reason}")
        self._registry.refused(peer, reason)

    async def _handle_connection(self, raw: SocketStream, peer: str, host: str) -> None:
        """The handshake of a connection counted in by :meth:`_admit`, then its session.
        It counts until it has authenticated, or else until it is closed."""
        framed: FramedStream | None = None
        session: FollowerSession | None = None
        counted = True
        try:
            with anyio.fail_after(self._settings.handshake_timeout):
                stream: ByteStream = raw
                if self._settings.ssl_context is not None:
                    stream = await TLSStream.wrap(
                        raw,
                        server_side=True,
                        ssl_context=self._settings.ssl_context,
                        standard_compatible=False,
                    )
                framed = FramedStream(stream, self._settings.max_frame_bytes)
                session = await self._handshake(framed, peer)
            self._admission.leave(host)
            counted = False
            await session.run()
        except _Refused as exc:
            self._refuse(exc.code, peer, exc.reason)
            await _try_reject(framed, exc.code, exc.reason)
        except TimeoutError:
            reason = f"no complete handshake within {self._settings.handshake_timeout} s"
            self._warnings.warn("timeout", f"closed a control connection from {peer}: {reason}")
            self._registry.refused(peer, reason)
            await _try_reject(framed, "protocol", reason)
        except (anyio.EndOfStream, anyio.BrokenResourceError, OSError) as exc:
            self._warnings.warn(
                "broken", f"a control connection from {peer} broke in the handshake: {exc!r}"
            )
            self._registry.refused(peer, f"the connection broke in the handshake ({exc!r})")
        except Exception:
            logger.exception("unexpected error on a control connection from %s", peer)
            if session is not None:
                session.lost("the root's connection handler failed")
        finally:
            await aclose_shielded(framed, raw)
            if counted:
                self._admission.leave(host)
            if session is not None and not session.forgotten:
                self._registry.leave(session.rank)

    async def _handshake(self, framed: FramedStream, peer: str) -> FollowerSession:
        try:
            hello = await framed.receive()
            if not isinstance(hello, Hello):
                raise _Refused("protocol", f"expected a 'hello' frame, got '{hello.TAG}'")
            root_nonce = new_nonce()
            await framed.send(Challenge(nonce=root_nonce))
            auth = await framed.receive()
        except ProtocolError as exc:
            raise _Refused("protocol", exc.message) from None
        if not isinstance(auth, Auth):
            raise _Refused("protocol", f"expected an 'auth' frame, got '{auth.TAG}'")
        rank, nonces = hello.rank, {"follower_nonce": hello.nonce, "root_nonce": root_nonce}
        if not verify_proof(self._key, "follower", auth.proof, rank=rank, **nonces):
            raise _Refused(
                "auth",
                f"authentication failed for rank {rank}: its secret differs from the root's",
            )
        if not hello.heartbeat_interval < self._settings.heartbeat_timeout:
            raise _Refused(
                "mismatch",
                f"the follower's heartbeat_interval ({hello.heartbeat_interval} s) must be "
                f"below the root's heartbeat_timeout ({self._settings.heartbeat_timeout} s)",
            )
        reason = self._registry.admission_error(rank)
        if reason is not None:
            raise _Refused("join", reason)
        session = FollowerSession(rank, framed, self._registry, self._settings)
        self._sessions[rank] = session
        self._registry.admit(rank)
        welcome = Welcome(
            proof=make_proof(self._key, "root", rank=rank, **nonces),
            heartbeat_interval=self._settings.heartbeat_interval,
        )
        session.enqueue(encode_frame(welcome, self._settings.max_frame_bytes))
        if self._registry.clique_id is not None:
            session.enqueue(self._clique_frame(self._registry.clique_id))
            session.clique_sent = True
        logger.debug("rank %d joined from %s", rank, peer, extra={"rank": rank})
        return session

    def _clique_frame(self, clique_id: CliqueId) -> bytes:
        return encode_frame(CliqueMessage(clique_id=clique_id), self._settings.max_frame_bytes)

    async def publish_clique_id(self, clique_id: CliqueId) -> None:
        """See :meth:`RootChannel.publish_clique_id`."""
        self._check_open("publish")
        await anyio.lowlevel.checkpoint()
        if not self._registry.publish(clique_id):
            return
        frame = self._clique_frame(clique_id)
        for session in self._sessions.values():
            if not session.clique_sent:  # the others learn a new generation's id by REJOIN
                session.enqueue(frame)
                session.clique_sent = True

    async def lost_followers(self) -> dict[int, LampdistError]:
        """See :meth:`RootChannel.lost_followers`."""
        await anyio.lowlevel.checkpoint()
        return self._registry.lost_followers()

    async def forget(self, ranks: Collection[int]) -> None:
        """See :meth:`RootChannel.forget`."""
        self._check_open("recover")
        await anyio.lowlevel.checkpoint()
        for rank in ranks:
            session = self._sessions.pop(rank, None)
            if session is not None:
                session.forget()
        self._registry.forget(ranks)
        logger.info(
            "forgot ranks %s: new processes may join as them", sorted(ranks), extra={"rank": 0}
        )

    async def peers(self) -> int:
        """See :meth:`RootChannel.peers`."""
        await anyio.lowlevel.checkpoint()
        return len(self._registry.live)

    async def wait_for_peers(self, n: int, timeout: float | None) -> None:  # noqa: ASYNC109
        """See :meth:`RootChannel.wait_for_peers`."""
        self._check_open("join")
        await self._registry.wait_for_peers(n, timeout)

    async def broadcast(
        self,
        command: Command,
        *,
        timeout: float | UseChannelDefault | None = USE_CHANNEL_DEFAULT,  # noqa: ASYNC109
    ) -> None:
        """See :meth:`RootChannel.broadcast`: returns once every follower acknowledged."""
        self._check_open("broadcast")
        limit = resolve_timeout(timeout, self._broadcast_timeout, rank=0, phase="broadcast")
        registry = self._registry
        registry.check_broadcast(command)
        self._seq += 1
        seq = self._seq
        frame = encode_frame(
            CommandMessage(seq=seq, command=command), self._settings.max_frame_bytes
        )
        errors: list[LampdistError] = []
        targets: list[FollowerSession] = []
        for rank in sorted(registry.joined):
            failure = registry.failures.get(rank)
            if failure is not None:
                errors.append(copy_error(failure))
            elif self._sessions[rank].ended:
                errors.append(PeerDisconnected("the follower left", rank=rank, phase="broadcast"))
            else:
                targets.append(self._sessions[rank])
        ack_round = AckRound(seq, {session.rank for session in targets})
        for session in targets:
            session.ack_round = ack_round
            if command.kind is CommandKind.STOP:
                session.stop_seq = seq
        with anyio.move_on_after(limit):
            for session in targets:
                await session.send(frame)
            if ack_round.waiting:
                await ack_round.done.wait()
        for session in targets:
            if session.acked_seq >= seq:
                continue
            failure = registry.failures.get(session.rank)
            if failure is not None:
                errors.append(copy_error(failure))
            elif session.ended:
                errors.append(
                    PeerDisconnected(
                        "the follower left before acknowledging",
                        rank=session.rank,
                        phase="broadcast",
                    )
                )
            else:
                errors.append(
                    LampdistTimeout(
                        f"no acknowledgement of {command.kind.name} within {limit} s",
                        rank=session.rank,
                        phase="broadcast",
                    )
                )
        if errors:
            errors.sort(key=lambda error: error.rank or 0)
            for extra in errors[1:]:
                logger.log(
                    self._registry.failure_level,
                    "broadcast of %s: also %s",
                    command.kind.name,
                    extra,
                )
            raise errors[0]

    async def wait_until_left(self, ranks: Collection[int], timeout: float) -> None:  # noqa: ASYNC109
        """See :meth:`RootChannel.wait_until_left`."""
        await self._registry.wait_until_left(ranks, timeout)

    async def watch(self) -> NoReturn:
        """See :meth:`RootChannel.watch`."""
        await self._registry.watch()


async def _try_reject(framed: FramedStream | None, code: RejectCode, reason: str) -> None:
    """Tell a refused peer why, if it listens (best effort, bounded)."""
    if framed is None:
        return
    with (
        anyio.move_on_after(_REJECT_TIMEOUT),
        contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError),
    ):
        await framed.send(Reject(code=code, reason=reason))


def _peer_name(stream: SocketStream) -> tuple[str, str]:
    """How to name the peer of ``stream`` (``"10.0.0.2:51234"``), and its address alone."""
    try:
        address = stream.extra(SocketAttribute.remote_address)
    except (OSError, anyio.TypedAttributeLookupError):
        return "an unknown peer", "unknown"
    if isinstance(address, tuple):
        host = str(address[0]).removeprefix("::ffff:")  # an IPv4 peer of a dual-stack socket
        return f"{address[0]}:{address[1]}", host
    return str(address), str(address)


def tcp_root(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    nranks: int,
    secret: str | bytes | None,
    insecure: bool = False,
    ssl_context: ssl.SSLContext | None = None,
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    broadcast_timeout: float | None = DEFAULT_BROADCAST_TIMEOUT,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> TcpRootChannel:
    """The root side of a TCP control channel, as an async context manager.

    ``async with tcp_root(nranks=4, secret=s) as root:`` listens on ``host:port`` (127.0.0.1
    and a free port by default; see :attr:`TcpRootChannel.address`) and accepts followers
    that prove they hold ``secret`` (the same ``str`` or ``bytes`` on every rank; it never
    crosses the wire). ``ssl_context`` (a server context) turns on TLS. Heartbeats go both
    ways every ``heartbeat_interval`` seconds; a follower silent for ``heartbeat_timeout``
    counts as disconnected. A connection gets ``handshake_timeout`` seconds to authenticate;
    frames over ``max_frame_bytes`` are refused. At most 64 connections may be in their
    handshake at once, 16 from one address (each plus one per follower); one over a bound
    is closed as soon as it is accepted. Bad peers are refused with WARNING log lines, at
    most one per kind of refusal every 10 s (the next one counts those held back), and never
    disturb the followers that joined; nor does the root's process running out of file
    descriptors, after which it accepts again (see ``docs/threat-model.md``).

    Raises :class:`lampdist.ConfigError` for bad settings, and without a secret unless
    ``insecure=True`` (for a trusted network only); :class:`lampdist.ControlError` on
    entering if it cannot listen, and from :meth:`~RootChannel.watch` and
    :meth:`~RootChannel.wait_for_peers` if its listener fails later.
    """
    key = secret_bytes(secret, insecure=insecure, rank=0)
    if not isinstance(nranks, int) or isinstance(nranks, bool) or nranks < 1:
        raise ConfigError(
            f"nranks must be an integer >= 1, got {nranks!r}", rank=0, phase="configure"
        )
    settings = check_settings(
        rank=0,
        ssl_context=ssl_context,
        heartbeat_interval=heartbeat_interval,
        heartbeat_timeout=heartbeat_timeout,
        handshake_timeout=handshake_timeout,
        max_frame_bytes=max_frame_bytes,
    )
    resolve_timeout(broadcast_timeout, None, rank=0, phase="configure")
    return TcpRootChannel(
        nranks=nranks,
        host=host,
        port=port,
        key=key,
        settings=settings,
        broadcast_timeout=broadcast_timeout,
    )
