"""The TCP control channel's wire format: versioned JSON messages in length-prefixed frames.

A frame is a 4-byte big-endian payload length followed by the payload, a UTF-8 JSON object
``{"v": 1, "t": "<type>", ...fields}``. Nothing on the wire is ever unpickled. A frame longer
than the receiver's limit is refused before it is buffered, so a peer cannot make a rank hold
more than one frame's worth of memory. Every decoding failure is a
:class:`lampdist.ProtocolError`.

Messages (F = follower, R = root)::

    F->R hello      {rank, nonce, heartbeat_interval}   opens the handshake
    R->F challenge  {nonce}
    F->R auth       {proof}                              HMAC of the transcript, follower role
    R->F welcome    {proof, heartbeat_interval}          HMAC of the transcript, root role
    R->F reject     {code, reason}                       the root refuses; the connection ends
    R->F clique     {clique_id}                          once, when the clique id is known
    R->F command    {seq, command}                       a STOP in order carries the
                                                         root's final loop state
    F->R ack        {seq}                                the follower holds the command
    F->R failure    {phase, message}                     the follower failed
    both ping       {}                                   heartbeat
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import struct
from collections import deque
from typing import Any, ClassVar, Literal, TypeAlias, cast

import anyio
import attrs
from anyio.abc import ByteStream

from .._clique_id import CliqueId
from .._errors import Phase, ProtocolError
from ._command import MAX_TEXT_CHARS, Command, clip_text

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "MIN_MAX_FRAME_BYTES",
    "NONCE_BYTES",
    "PROTOCOL_VERSION",
    "Ack",
    "Auth",
    "Challenge",
    "CliqueMessage",
    "CommandMessage",
    "FailureReport",
    "FrameDecoder",
    "FramedStream",
    "Hello",
    "Message",
    "Ping",
    "Reject",
    "RejectCode",
    "Welcome",
    "decode_payload",
    "encode_frame",
]

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
DEFAULT_MAX_FRAME_BYTES = 64 * 1024
MIN_MAX_FRAME_BYTES = 16 * 1024
NONCE_BYTES = 32
_PROOF_BYTES = 32
_HEADER = struct.Struct(">I")
_RECEIVE_CHUNK = 64 * 1024

RejectCode: TypeAlias = Literal["auth", "join", "mismatch", "protocol"]
_REJECT_CODES: tuple[RejectCode, ...] = ("auth", "join", "mismatch", "protocol")


# -- field readers: each raises ProtocolError naming the field ------------------------------


def _int(data: dict[str, Any], key: str, *, low: int = 0, high: int = 2**53) -> int:
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ProtocolError(f"field {key!r} must be an integer in {low}..{high}, got {value!r}")
    return value


def _positive_float(data: dict[str, Any], key: str) -> float:
    value = data.get(key)
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ProtocolError(f"field {key!r} must be a positive number, got {value!r}")
    return float(value)


def _text(data: dict[str, Any], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or len(value) > MAX_TEXT_CHARS:
        raise ProtocolError(f"field {key!r} must be a string of at most {MAX_TEXT_CHARS} chars")
    return value


def _hex(data: dict[str, Any], key: str, nbytes: int) -> bytes:
    value = data.get(key)
    if not isinstance(value, str) or len(value) != 2 * nbytes:
        raise ProtocolError(f"field {key!r} must be {2 * nbytes} hex digits")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ProtocolError(f"field {key!r} must be {2 * nbytes} hex digits") from None


# -- messages -------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Hello:
    """The follower's first frame: its rank, a fresh nonce and its heartbeat interval."""

    TAG: ClassVar[str] = "hello"
    rank: int
    nonce: bytes
    heartbeat_interval: float

    def fields(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "nonce": self.nonce.hex(),
            "heartbeat_interval": self.heartbeat_interval,
        }

    @classmethod
    def parse(cls, data: dict[str, Any]) -> Hello:
        return cls(
            rank=_int(data, "rank", high=2**31),
            nonce=_hex(data, "nonce", NONCE_BYTES),
            heartbeat_interval=_positive_float(data, "heartbeat_interval"),
        )


@attrs.frozen(kw_only=True)
class Challenge:
    """The root's nonce; the follower answers with :class:`Auth`."""

    TAG: ClassVar[str] = "challenge"
    nonce: bytes

    def fields(self) -> dict[str, Any]:
        return {"nonce": self.nonce.hex()}

    @classmethod
    def parse(cls, data: dict[str, Any]) -> Challenge:
        return cls(nonce=_hex(data, "nonce", NONCE_BYTES))


@attrs.frozen(kw_only=True)
class Auth:
    """The follower's proof that it holds the secret."""

    TAG: ClassVar[str] = "auth"
    proof: bytes

    def fields(self) -> dict[str, Any]:
        return {"proof": self.proof.hex()}

    @classmethod
    def parse(cls, data: dict[str, Any]) -> Auth:
        return cls(proof=_hex(data, "proof", _PROOF_BYTES))


@attrs.frozen(kw_only=True)
class Welcome:
    """The root accepts the follower and proves that it holds the secret, too."""

    TAG: ClassVar[str] = "welcome"
    proof: bytes
    heartbeat_interval: float

    def fields(self) -> dict[str, Any]:
        return {"proof": self.proof.hex(), "heartbeat_interval": self.heartbeat_interval}

    @classmethod
    def parse(cls, data: dict[str, Any]) -> Welcome:
        return cls(
            proof=_hex(data, "proof", _PROOF_BYTES),
            heartbeat_interval=_positive_float(data, "heartbeat_interval"),
        )


@attrs.frozen(kw_only=True)
class Reject:
    """The root refuses the connection; ``code`` picks the error the follower raises."""

    TAG: ClassVar[str] = "reject"
    code: RejectCode
    reason: str

    def fields(self) -> dict[str, Any]:
        return {"code": self.code, "reason": clip_text(self.reason)}

    @classmethod
    def parse(cls, data: dict[str, Any]) -> Reject:
        code = data.get("code")
        for known in _REJECT_CODES:
            if code == known:
                return cls(code=known, reason=_text(data, "reason"))
        raise ProtocolError(f"unknown rejection code {code!r}")


@attrs.frozen(kw_only=True)
class CliqueMessage:
    """The clique id of the run."""

    TAG: ClassVar[str] = "clique"
    clique_id: CliqueId

    def fields(self) -> dict[str, Any]:
        return {"clique_id": self.clique_id.to_json()}

    @classmethod
    def parse(cls, data: dict[str, Any]) -> CliqueMessage:
        return cls(clique_id=CliqueId.from_json(data.get("clique_id")))


@attrs.frozen(kw_only=True)
class CommandMessage:
    """A command, numbered so that the follower can acknowledge it."""

    TAG: ClassVar[str] = "command"
    seq: int
    command: Command

    def fields(self) -> dict[str, Any]:
        return {"seq": self.seq, "command": self.command.to_json()}

    @classmethod
    def parse(cls, data: dict[str, Any]) -> CommandMessage:
        return cls(seq=_int(data, "seq"), command=Command.from_json(data.get("command")))


@attrs.frozen(kw_only=True)
class Ack:
    """The follower holds every command up to ``seq``."""

    TAG: ClassVar[str] = "ack"
    seq: int

    def fields(self) -> dict[str, Any]:
        return {"seq": self.seq}

    @classmethod
    def parse(cls, data: dict[str, Any]) -> Ack:
        return cls(seq=_int(data, "seq"))


@attrs.frozen(kw_only=True)
class FailureReport:
    """The follower failed in ``phase``; ``message`` says how."""

    TAG: ClassVar[str] = "failure"
    phase: Phase
    message: str

    def fields(self) -> dict[str, Any]:
        return {"phase": clip_text(self.phase, 64), "message": clip_text(self.message)}

    @classmethod
    def parse(cls, data: dict[str, Any]) -> FailureReport:
        # The peer is an authenticated rank of this protocol version: its phase is a Phase.
        phase = cast("Phase", _text(data, "phase"))
        return cls(phase=phase, message=_text(data, "message"))


@attrs.frozen(kw_only=True)
class Ping:
    """A heartbeat."""

    TAG: ClassVar[str] = "ping"

    def fields(self) -> dict[str, Any]:
        return {}

    @classmethod
    def parse(cls, data: dict[str, Any]) -> Ping:
        return cls()


Message: TypeAlias = (
    Hello
    | Challenge
    | Auth
    | Welcome
    | Reject
    | CliqueMessage
    | CommandMessage
    | Ack
    | FailureReport
    | Ping
)
_PARSERS: dict[str, Any] = {
    kind.TAG: kind.parse
    for kind in (
        Hello,
        Challenge,
        Auth,
        Welcome,
        Reject,
        CliqueMessage,
        CommandMessage,
        Ack,
        FailureReport,
        Ping,
    )
}


def _reject_constant(name: str) -> Any:
    raise ProtocolError(f"{name} is not a valid number here")


def _payload(message: Message) -> bytes:
    body = {"v": PROTOCOL_VERSION, "t": message.TAG, **message.fields()}
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


def _fit_state(message: CommandMessage, max_frame_bytes: int) -> bytes | None:
    """The payload of ``message``, a STOP whose loop state makes it too long, with the state's
    learning curve cut to its newest points that fit (``None`` if not even an empty curve
    fits). The followers' copy of the final state is then shorter than the root's, which
    returns the whole of it: raise ``max_frame_bytes`` (the channels' option) to carry it."""
    state = message.command.state
    assert state is not None
    curve = state.learning_curve

    def payload(kept: int) -> bytes:
        cut = attrs.evolve(state, learning_curve=curve[len(curve) - kept :])
        command = attrs.evolve(message.command, state=cut)
        return _payload(attrs.evolve(message, command=command))

    low, high = 0, len(curve)  # payload(low) fits, if anything does; payload(high) does not
    best = payload(0)
    if len(best) > max_frame_bytes:
        return None
    while high - low > 1:
        middle = (low + high) // 2
        candidate = payload(middle)
        if len(candidate) <= max_frame_bytes:
            low, best = middle, candidate
        else:
            high = middle
    logger.warning(
        "the STOP's loop state holds %d epochs of learning curve, more than a frame of %d "
        "bytes carries: the followers get the newest %d (raise the control channel's "
        "max_frame_bytes for the whole curve)",
        len(curve),
        max_frame_bytes,
        low,
        extra={"rank": 0},
    )
    return best


def encode_frame(message: Message, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """The frame (header and payload) of ``message``; raises :class:`lampdist.ProtocolError`
    if it would exceed ``max_frame_bytes``, except for a STOP whose loop state is too long:
    its learning curve is cut to the newest epochs that fit (logged as a warning)."""
    payload = _payload(message)
    if (
        len(payload) > max_frame_bytes
        and isinstance(message, CommandMessage)
        and message.command.state is not None
    ):
        payload = _fit_state(message, max_frame_bytes) or payload
    if len(payload) > max_frame_bytes:
        raise ProtocolError(
            f"a '{message.TAG}' frame of {len(payload)} bytes exceeds the limit of "
            f"{max_frame_bytes} bytes"
        )
    return _HEADER.pack(len(payload)) + payload


def decode_payload(payload: bytes) -> Message:
    """Parse one frame's payload; raises :class:`lampdist.ProtocolError` on anything but a
    well-formed message of this protocol version."""
    try:
        data = json.loads(payload.decode("utf-8"), parse_constant=_reject_constant)
    except ProtocolError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"a frame is not UTF-8 JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"a frame must hold a JSON object, got {type(data).__name__}")
    version = data.get("v")
    if version != PROTOCOL_VERSION or isinstance(version, bool):
        raise ProtocolError(
            f"unsupported control protocol version {version!r}; this lampdist speaks "
            f"version {PROTOCOL_VERSION} (run the same lampdist version on every rank)"
        )
    tag = data.get("t")
    parse = _PARSERS.get(tag) if isinstance(tag, str) else None
    if parse is None:
        raise ProtocolError(f"unknown message type {data.get('t')!r}")
    message: Message = parse(data)
    return message


@attrs.define(eq=False)
class FrameDecoder:
    """Cuts a byte stream into messages; holds less than one frame (plus its header) between
    calls, and refuses a frame over ``max_frame_bytes`` as soon as its header arrives.

    After it raised :class:`lampdist.ProtocolError` once it stays broken (the connection is
    to be closed).
    """

    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    _buffer: bytearray = attrs.field(factory=bytearray, init=False)
    _broken: bool = attrs.field(default=False, init=False)

    def _frame_length(self) -> int:
        (length,) = _HEADER.unpack_from(self._buffer)
        if length > self.max_frame_bytes:
            raise ProtocolError(
                f"a frame of {length} bytes exceeds the limit of {self.max_frame_bytes} bytes"
            )
        return int(length)

    def feed(self, data: bytes) -> list[Message]:
        """Add ``data``; return the messages it completes, in order."""
        if self._broken:
            raise ProtocolError("the stream already sent a bad frame")
        self._buffer += data
        messages: list[Message] = []
        try:
            while len(self._buffer) >= _HEADER.size:
                length = self._frame_length()
                end = _HEADER.size + length
                if len(self._buffer) < end:
                    break
                payload = bytes(self._buffer[_HEADER.size : end])
                del self._buffer[:end]
                messages.append(decode_payload(payload))
        except ProtocolError:
            self._broken = True
            self._buffer.clear()
            raise
        return messages


@attrs.define(eq=False)
class FramedStream:
    """Messages over a byte stream. ``receive`` raises :class:`lampdist.ProtocolError` on a bad
    frame and the stream's own errors (``anyio.EndOfStream``, ``BrokenResourceError``, ...)."""

    stream: ByteStream
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    _decoder: FrameDecoder = attrs.field(init=False)
    _pending: deque[Message] = attrs.field(factory=deque, init=False)

    def __attrs_post_init__(self) -> None:
        self._decoder = FrameDecoder(self.max_frame_bytes)

    async def receive(self) -> Message:
        """The next message."""
        while not self._pending:
            data = await self.stream.receive(_RECEIVE_CHUNK)
            self._pending.extend(self._decoder.feed(data))
        return self._pending.popleft()

    async def send(self, message: Message) -> None:
        """Send one message."""
        await self.stream.send(encode_frame(message, self.max_frame_bytes))

    async def send_frame(self, frame: bytes) -> None:
        """Send a frame made by :func:`encode_frame`."""
        await self.stream.send(frame)

    async def aclose(self) -> None:
        """Close the stream (never raises for a stream that is already broken)."""
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await self.stream.aclose()
