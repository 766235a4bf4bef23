"""A follower side of the TCP control channel."""

from __future__ import annotations

import logging
import os
import random
import ssl
from typing import NoReturn, TypeVar

import anyio
import anyio.lowlevel
import attrs
from anyio.abc import ByteStream, ObjectSendStream, TaskGroup
from anyio.streams.tls import TLSStream

from .._clique_id import CliqueId
from .._errors import (
    AuthenticationError,
    ConfigError,
    ControlError,
    JoinRejected,
    JoinTimeout,
    LampdistError,
    MismatchError,
    Phase,
    ProtocolError,
)
from ._auth import make_proof, new_nonce, secret_bytes, verify_proof
from ._bookkeeping import CommandRelay, FollowerState, Notifier, Waiting
from ._command import Command, CommandKind
from ._lifecycle import ChannelLifecycle, aclose_shielded
from ._protocols import (
    DEFAULT_JOIN_TIMEOUT,
    USE_CHANNEL_DEFAULT,
    UseChannelDefault,
    resolve_timeout,
)
from ._settings import (
    DEFAULT_HANDSHAKE_TIMEOUT,
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_HEARTBEAT_TIMEOUT,
    Liveness,
    TcpSettings,
    check_settings,
)
from ._wire import (
    DEFAULT_MAX_FRAME_BYTES,
    Ack,
    Auth,
    Challenge,
    CliqueMessage,
    CommandMessage,
    FailureReport,
    FramedStream,
    Hello,
    Message,
    Ping,
    Reject,
    Welcome,
)

__all__ = ["TcpFollowerChannel", "tcp_follower"]

logger = logging.getLogger(__name__)

_M = TypeVar("_M", Hello, Challenge, Auth, Welcome)
_FIRST_RETRY_DELAY = 0.05
_MAX_RETRY_DELAY = 1.0
_REPORT_TIMEOUT = 1.0
ROOT_EXIT_HEAD_START = 1.0
"""After the root closed its channel, how long :meth:`TcpFollowerChannel.wait_until_root_left`
lets the root's process end (its interpreter's shutdown), so that it ends first."""


@attrs.define(eq=False)
class TcpFollowerChannel(ChannelLifecycle):
    """A follower side of the TCP control channel; see :class:`FollowerChannel` and
    :func:`tcp_follower`."""

    rank: int
    _host: str
    _port: int
    _key: bytes = attrs.field(repr=False)
    _settings: TcpSettings
    _join_timeout: float | None
    _follower: FollowerState = attrs.field(init=False)
    _framed: FramedStream | None = None
    _commands: ObjectSendStream[Command] | None = None
    _send_lock: anyio.Lock | None = None
    _clique_id: CliqueId | None = None
    _join_error: LampdistError | None = None
    _joined: bool = False
    _session_done: bool = False
    _progress: Notifier = attrs.field(factory=Notifier)
    _live: Liveness = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._follower = FollowerState(rank=self.rank)

    def _identity(self) -> tuple[str, int]:
        return f"the channel of rank {self.rank}", self.rank

    async def _prepare(self) -> None:
        self._send_lock = anyio.Lock(fast_acquire=True)

    async def _closed(self) -> None:
        await aclose_shielded(self._framed, self._commands)

    # -- join -------------------------------------------------------------------------------

    async def join(
        self,
        commands: ObjectSendStream[Command],
        *,
        timeout: float | UseChannelDefault | None = USE_CHANNEL_DEFAULT,  # noqa: ASYNC109
    ) -> CliqueId:
        """See :meth:`FollowerChannel.join`: connects (retrying while the root is not
        listening), authenticates both ways and waits for the clique id."""
        self._check_open("join")
        if self._joined:
            raise ControlError("join() was already called", rank=self.rank, phase="join")
        self._joined = True
        limit = resolve_timeout(timeout, self._join_timeout, rank=self.rank, phase="join")
        stage = "connect"
        last_error: BaseException | None = None
        waiting = Waiting(limit)
        with anyio.move_on_after(limit):
            delay = _FIRST_RETRY_DELAY
            while True:
                try:
                    stream: ByteStream = await anyio.connect_tcp(self._host, self._port)
                    break
                except OSError as exc:
                    last_error = exc
                    logger.debug("rank %d: root not reachable yet (%s)", self.rank, exc)
                if waiting.report_due():
                    logger.warning(
                        "rank %d: no root listening at %s:%d yet (%s); retrying, %s",
                        self.rank,
                        self._host,
                        self._port,
                        _reason(last_error),
                        waiting.left(),
                        extra={"rank": self.rank},
                    )
                await anyio.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(2 * delay, _MAX_RETRY_DELAY)
            stage = "handshake"
            try:
                with anyio.fail_after(self._settings.handshake_timeout):
                    framed = await self._handshake(stream)
            except BaseException as exc:
                await aclose_shielded(stream)
                if isinstance(exc, TimeoutError) and not isinstance(exc, LampdistError):
                    raise JoinTimeout(
                        f"the root at {self._host}:{self._port} did not finish the handshake "
                        f"within {self._settings.handshake_timeout} s (handshake_timeout)",
                        rank=self.rank,
                        phase="handshake",
                    ) from None
                raise
            self._framed = framed
            stage = "clique"
            return await self._start(framed, commands)
        where = f"{self._host}:{self._port}"
        detail = {
            "connect": f"could not connect to the root at {where} (last error: {last_error})",
            "handshake": f"the handshake with the root at {where} did not finish",
            "clique": f"joined the root at {where}, but it published no clique id",
        }[stage]
        raise JoinTimeout(f"{detail} within {limit} s", rank=self.rank, phase="join")

    async def _handshake(self, stream: ByteStream) -> FramedStream:
        try:
            if self._settings.ssl_context is not None:
                stream = await TLSStream.wrap(
                    stream,
                    hostname=self._host,
                    ssl_context=self._settings.ssl_context,
                    standard_compatible=False,
                )
            framed = FramedStream(stream, self._settings.max_frame_bytes)
            follower_nonce = new_nonce()
            await framed.send(
                Hello(
                    rank=self.rank,
                    nonce=follower_nonce,
                    heartbeat_interval=self._settings.heartbeat_interval,
                )
            )
            challenge = self._expect(await framed.receive(), Challenge)
            nonces = {"follower_nonce": follower_nonce, "root_nonce": challenge.nonce}
            proof = make_proof(self._key, "follower", rank=self.rank, **nonces)
            await framed.send(Auth(proof=proof))
            welcome = self._expect(await framed.receive(), Welcome)
        except ssl.SSLCertVerificationError as exc:
            raise AuthenticationError(
                f"the root's TLS certificate failed verification ({exc.verify_message})",
                rank=self.rank,
                phase="handshake",
            ) from exc
        except ssl.SSLError as exc:
            raise ProtocolError(
                f"the TLS handshake with the root failed ({exc}); do both sides use TLS?",
                rank=self.rank,
                phase="handshake",
            ) from exc
        except ProtocolError as exc:
            raise ProtocolError(exc.message, rank=self.rank, phase="handshake") from None
        except (anyio.EndOfStream, anyio.BrokenResourceError, OSError) as exc:
            raise JoinRejected(
                f"the root closed the connection during the handshake ({exc!r}); is it a "
                "lampdist root with the same TLS setting, and not flooded with connections "
                "(it closes those over its limits at once)?",
                rank=self.rank,
                phase="handshake",
            ) from exc
        if not verify_proof(self._key, "root", welcome.proof, rank=self.rank, **nonces):
            raise AuthenticationError(
                "the root failed the challenge: it does not hold this secret",
                rank=self.rank,
                phase="handshake",
            )
        if not welcome.heartbeat_interval < self._settings.heartbeat_timeout:
            raise MismatchError(
                f"the root's heartbeat_interval ({welcome.heartbeat_interval} s) must be below "
                f"this follower's heartbeat_timeout ({self._settings.heartbeat_timeout} s)",
                rank=self.rank,
                phase="handshake",
            )
        return framed

    def _expect(self, message: Message, kind: type[_M]) -> _M:
        if isinstance(message, kind):
            return message
        if isinstance(message, Reject):
            error = {
                "auth": AuthenticationError,
                "join": JoinRejected,
                "mismatch": MismatchError,
                "protocol": ProtocolError,
            }[message.code]
            phase: Phase = "join" if message.code in ("join", "mismatch") else "handshake"
            raise error(f"the root refused: {message.reason}", rank=self.rank, phase=phase)
        raise ProtocolError(f"expected '{kind.TAG}' from the root, got '{message.TAG}'")

    async def _start(self, framed: FramedStream, commands: ObjectSendStream[Command]) -> CliqueId:
        self._live = Liveness(self._settings.heartbeat_timeout)
        relay = CommandRelay(self._follower, commands)
        self._commands = commands
        assert self._task_group is not None  # set by __aenter__
        self._task_group.start_soon(self._session, framed, relay)
        self._task_group.start_soon(relay.run)
        while self._clique_id is None:
            if self._session_done:
                raise self._join_error or JoinRejected(
                    "the root closed before publishing the clique id",
                    rank=self.rank,
                    phase="join",
                )
            await self._progress.wait()
        return self._clique_id

    # -- session ----------------------------------------------------------------------------

    async def _send(self, message: Message) -> None:
        assert self._framed is not None  # joined
        assert self._send_lock is not None  # set by __aenter__
        async with self._send_lock:
            self._live.sending_since = anyio.current_time()
            await self._framed.send(message)
            self._live.sending_since = None

    async def _session(self, framed: FramedStream, relay: CommandRelay) -> None:
        try:
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(self._read, framed, relay, task_group)
                task_group.start_soon(self._watchdog, task_group)
        finally:
            self._session_done = True
            relay.end()
            self._progress.notify()

    def _lost(self, reason: str, *, silent: bool = False, rank: int = 0) -> None:
        if self._clique_id is None and self._join_error is None:
            self._join_error = JoinRejected(
                f"lost the root before it published the clique id: {reason}",
                rank=self.rank,
                phase="join",
            )
        self._follower.root_lost(reason, silent=silent, rank=rank)

    async def _read(self, framed: FramedStream, relay: CommandRelay, task_group: TaskGroup) -> None:
        try:
            while True:
                message = await framed.receive()
                self._live.heard()
                await self._on_message(message, relay)
        except anyio.EndOfStream:
            self._lost("the root closed the control channel without STOP")
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            self._lost(f"the control connection broke ({exc!r})")
        except ProtocolError as exc:
            logger.warning("rank %d: bad frame from the root: %s", self.rank, exc.message)
            self._lost(f"the root sent a bad frame ({exc.message})")
        task_group.cancel_scope.cancel()

    async def _on_message(self, message: Message, relay: CommandRelay) -> None:
        if isinstance(message, CliqueMessage) and self._clique_id is None:
            self._clique_id = message.clique_id
            self._progress.notify()
        elif isinstance(message, CommandMessage) and self._clique_id is not None:
            if message.command.kind is CommandKind.STOP:
                self._follower.stopped = True  # from now on, losing the root is no failure
            await self._send(Ack(seq=message.seq))
            relay.put(message.command)
        elif not isinstance(message, Ping):
            raise ProtocolError(f"unexpected '{message.TAG}' frame from the root")

    async def _watchdog(self, task_group: TaskGroup) -> None:
        interval, timeout = self._settings.heartbeat_interval, self._settings.heartbeat_timeout
        try:
            while True:
                since = anyio.current_time()
                await anyio.sleep(interval)
                own = self._live.stalled_here(since)
                if own is not None:  # this rank's own stall: not the root's fault
                    message = f"{own}: the root has given up on it"
                    self._lost(message, silent=True, rank=self.rank)
                    break
                problem = self._live.problem()
                if problem is not None:
                    self._lost(f"{problem} on the connection to the root", silent=True)
                    break
                with anyio.move_on_after(timeout) as scope:
                    await self._send(Ping())
                if scope.cancelled_caught:
                    self._lost(f"a heartbeat to the root was stuck for {timeout} s", silent=True)
                    break
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            self._lost(f"the control connection broke ({exc!r})")
        task_group.cancel_scope.cancel()

    # -- failure ----------------------------------------------------------------------------

    async def report_failure(self, phase: Phase, message: str) -> None:
        """See :meth:`FollowerChannel.report_failure`."""
        await anyio.lowlevel.checkpoint()
        self._follower.reported = True
        if self._framed is None or self._session_done:
            logger.debug("rank %d: no root to report the failure to", self.rank)
            return
        with anyio.move_on_after(_REPORT_TIMEOUT):
            try:
                await self._send(FailureReport(phase=phase, message=message))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                logger.debug("rank %d: could not report the failure", self.rank)

    async def wait_until_root_left(self, timeout: float) -> None:  # noqa: ASYNC109
        """See :meth:`FollowerChannel.wait_until_root_left`: the channel closed, then
        :data:`ROOT_EXIT_HEAD_START` for the root's process to end."""
        with anyio.move_on_after(timeout):
            while self._framed is not None and not self._session_done:
                await self._progress.wait()
            await anyio.sleep(ROOT_EXIT_HEAD_START)

    async def watch(self) -> NoReturn:
        """See :meth:`FollowerChannel.watch`."""
        await self._follower.watch()


def tcp_follower(
    host: str,
    port: int,
    *,
    rank: int,
    secret: str | bytes | None,
    insecure: bool = False,
    ssl_context: ssl.SSLContext | None = None,
    join_timeout: float | None = DEFAULT_JOIN_TIMEOUT,
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> TcpFollowerChannel:
    """A follower side of a TCP control channel, as an async context manager.

    ``async with tcp_follower(host, port, rank=1, secret=s) as follower:`` then
    ``await follower.join(send_stream)`` connects to the root at ``host:port``, retrying with
    exponential backoff while it is not listening yet, authenticates both ways with
    ``secret`` and waits for the clique id, all within ``join_timeout`` (the default of
    ``join``'s ``timeout``). ``ssl_context`` (a client context that trusts the root's
    certificate) turns on TLS. Use the same heartbeat settings on every rank.

    Raises :class:`lampdist.ConfigError` for bad settings, and without a secret unless
    ``insecure=True``. ``join`` raises :class:`lampdist.AuthenticationError` at once when the
    secrets differ, :class:`lampdist.JoinRejected` with the root's reason when it refuses the
    rank, :class:`lampdist.JoinTimeout` when time runs out.
    """
    key = secret_bytes(secret, insecure=insecure, rank=rank)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ConfigError(
            f"rank must be an integer >= 1, got {rank!r}", rank=None, phase="configure"
        )
    settings = check_settings(
        rank=rank,
        ssl_context=ssl_context,
        heartbeat_interval=heartbeat_interval,
        heartbeat_timeout=heartbeat_timeout,
        handshake_timeout=handshake_timeout,
        max_frame_bytes=max_frame_bytes,
    )
    resolve_timeout(join_timeout, None, rank=rank, phase="configure")
    return TcpFollowerChannel(
        rank=rank,
        host=host,
        port=port,
        key=key,
        settings=settings,
        join_timeout=join_timeout,
    )


def _reason(error: BaseException | None) -> str:
    """An OS error as a person reads it: ``Connection refused``, not ``[Errno 111] ...``.

    anyio's ``connect_tcp`` raises "All connection attempts failed" from the attempts' own errors;
    the reason is the first attempt's.
    """
    cause = error.__cause__ if error is not None else None
    if isinstance(cause, BaseExceptionGroup) and cause.exceptions:
        cause = cause.exceptions[0]
    if isinstance(cause, OSError):
        error = cause
    if isinstance(error, OSError) and error.errno:
        return os.strerror(error.errno)
    return str(error)
