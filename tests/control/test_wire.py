"""The wire format and the commands: round trips, and a fuzzed decoder that fails only with
ProtocolError and never holds more than one frame."""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lampdist
from lampdist._clique_id import CliqueId
from lampdist.control import Command, CommandKind
from lampdist.control._auth import make_proof, new_nonce, secret_bytes, verify_proof
from lampdist.control._wire import (
    MIN_MAX_FRAME_BYTES,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    Ack,
    Auth,
    Challenge,
    CliqueMessage,
    CommandMessage,
    FailureReport,
    FrameDecoder,
    Hello,
    Message,
    Ping,
    Reject,
    Welcome,
    decode_payload,
    encode_frame,
)

LIMIT = MIN_MAX_FRAME_BYTES
TAGS = ["hello", "challenge", "auth", "welcome", "reject", "clique", "command", "ack", "failure"]

counts = st.integers(min_value=0, max_value=2**40)
texts = st.text(max_size=200)
positive = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False)
clique_ids = st.builds(
    CliqueId,
    host=st.text(min_size=1, max_size=50),
    port=st.integers(1, 65535),
    prefix=st.text(max_size=40),
    nranks=st.integers(1, 4096),
)
PLAIN_KINDS = [CommandKind.TRAIN, CommandKind.VALID, CommandKind.CHECKPOINT]
commands = st.one_of(
    st.builds(
        Command,
        kind=st.sampled_from(PLAIN_KINDS),
        epoch=counts,
        pass_index=counts,
        lr_factor=st.none() | st.floats(allow_nan=False, allow_infinity=False),
    ),
    st.builds(
        Command,
        kind=st.just(CommandKind.STOP),
        epoch=counts,
        pass_index=counts,
        error=st.none() | texts,
    ),
    st.builds(
        Command,
        kind=st.just(CommandKind.HOLD),
        epoch=counts,
        pass_index=counts,
        error=st.none() | texts,
        timeout=st.none() | positive,
    ),
    st.builds(
        Command,
        kind=st.just(CommandKind.REJOIN),
        epoch=counts,
        pass_index=counts,
        clique_id=clique_ids,
    ),
)
nonces = st.binary(min_size=NONCE_BYTES, max_size=NONCE_BYTES)
messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(Hello, rank=st.integers(0, 2**31), nonce=nonces, heartbeat_interval=positive),
    st.builds(Challenge, nonce=nonces),
    st.builds(Auth, proof=nonces),
    st.builds(Welcome, proof=nonces, heartbeat_interval=positive),
    st.builds(Reject, code=st.sampled_from(["auth", "join", "mismatch", "protocol"]), reason=texts),
    st.builds(CliqueMessage, clique_id=clique_ids),
    st.builds(CommandMessage, seq=counts, command=commands),
    st.builds(Ack, seq=counts),
    st.builds(FailureReport, phase=st.text(max_size=60), message=texts),
    st.just(Ping()),
)
FIELDS = ["rank", "nonce", "heartbeat_interval", "proof", "code", "reason", "clique_id"]
FIELDS += ["seq", "command", "phase", "message", "kind", "epoch", "pass_index", "lr_factor"]
FIELDS += ["timeout", "error"]
field_names = st.sampled_from(FIELDS) | st.text(max_size=8)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from(["train", "valid", "stop", "auth", "join", "00" * NONCE_BYTES]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(field_names, inner, max_size=4),
    max_leaves=12,
)


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def buffered(decoder: FrameDecoder) -> int:
    """The bytes ``decoder`` holds for an incomplete frame."""
    return len(decoder._buffer)


def feed_all(decoder: FrameDecoder, chunks: list[bytes]) -> list[Message]:
    """Feed every chunk; only ProtocolError may escape, and the buffer stays bounded."""
    out: list[Message] = []
    for chunk in chunks:
        try:
            out.extend(decoder.feed(chunk))
        except lampdist.ProtocolError:
            assert buffered(decoder) == 0
            return out
        assert buffered(decoder) < 4 + decoder.max_frame_bytes
    return out


@given(messages)
def test_every_message_survives_a_round_trip(message: Message) -> None:
    data = encode_frame(message)
    assert FrameDecoder().feed(data) == [message]


@given(st.lists(messages, max_size=5), st.data())
def test_messages_survive_any_chunking(batch: list[Message], data: st.DataObject) -> None:
    stream = b"".join(encode_frame(m) for m in batch)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    decoder = FrameDecoder()
    assert feed_all(decoder, chunks) == batch
    assert buffered(decoder) == 0


@settings(max_examples=300)
@given(st.lists(st.binary(max_size=3 * LIMIT), max_size=4))
def test_arbitrary_bytes_yield_messages_or_protocol_error(chunks: list[bytes]) -> None:
    feed_all(FrameDecoder(LIMIT), chunks)


@settings(max_examples=300)
@given(st.binary(max_size=2 * LIMIT))
def test_well_framed_garbage_yields_a_message_or_protocol_error(payload: bytes) -> None:
    feed_all(FrameDecoder(LIMIT), [frame(payload)])


@settings(max_examples=200)
@given(st.sampled_from(TAGS), st.dictionaries(field_names, json_values, max_size=5))
def test_json_with_the_right_envelope_yields_a_message_or_protocol_error(
    tag: str, fields: dict[str, Any]
) -> None:
    body = {**fields, "v": PROTOCOL_VERSION, "t": tag}
    try:
        message = decode_payload(json.dumps(body).encode())
    except lampdist.ProtocolError:
        return
    assert tag == message.TAG


@pytest.mark.parametrize(
    "payload",
    [
        b"[" * 50_000 + b"]" * 50_000,  # deep nesting
        b'{"v": 1, "t": "ack", "seq": ' + b"9" * 10_000 + b"}",  # huge integer
        b'{"v": 1, "t": "hello", "rank": 1, "nonce": "00", "heartbeat_interval": NaN}',
        b'{"v": 1, "t": ["unhashable"]}',
        b'{"v": true, "t": "ping"}',
        b'{"v": 2, "t": "ping"}',
        b'{"v": 1, "t": "ack", "seq": true}',
        b'{"v": 1, "t": "command", "seq": 1, "command": {"kind": "valid", "epoch": 0,'
        b' "pass_index": 0, "error": "only STOP carries one"}}',
        b'{"v": 1, "t": "command", "seq": 1, "command": {"kind": "train", "epoch": -1,'
        b' "pass_index": 0}}',
        b'{"v": 1, "t": "command", "seq": 1, "command": {"kind": "train", "epoch": 0,'
        b' "pass_index": 0, "lr_factor": 1e999}}',
        b"\xc3\x28",  # invalid UTF-8
        b"",
    ],
)
def test_hostile_payloads_are_protocol_errors(payload: bytes) -> None:
    with pytest.raises(lampdist.ProtocolError):
        decode_payload(payload)


def test_an_oversize_header_is_refused_before_its_body_arrives() -> None:
    decoder = FrameDecoder(LIMIT)
    with pytest.raises(lampdist.ProtocolError, match="exceeds the limit"):
        decoder.feed(struct.pack(">I", 2**32 - 1))
    assert buffered(decoder) == 0
    with pytest.raises(lampdist.ProtocolError):  # and it stays broken
        decoder.feed(encode_frame(Ping()))


def test_an_encoder_refuses_a_frame_over_the_limit() -> None:
    clique = CliqueId(host="h" * 70_000, port=1, prefix="p", nranks=2)
    with pytest.raises(lampdist.ProtocolError, match="exceeds the limit"):
        encode_frame(CliqueMessage(clique_id=clique))


# -- commands --------------------------------------------------------------------------------


@given(commands)
def test_commands_survive_json(command: Command) -> None:
    assert Command.from_json(json.loads(json.dumps(command.to_json()))) == command


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": "train", "epoch": 0, "pass_index": 0},
        {"kind": CommandKind.TRAIN, "epoch": -1, "pass_index": 0},
        {"kind": CommandKind.TRAIN, "epoch": 0, "pass_index": True},
        {"kind": CommandKind.TRAIN, "epoch": 0, "pass_index": 0, "lr_factor": math.inf},
        {"kind": CommandKind.VALID, "epoch": 0, "pass_index": 0, "error": "no"},
    ],
)
def test_invalid_commands_are_config_errors(kwargs: dict[str, Any]) -> None:
    with pytest.raises(lampdist.ConfigError):
        Command(**kwargs)


# -- authentication --------------------------------------------------------------------------


def test_proofs_bind_the_secret_the_role_the_rank_and_both_nonces() -> None:
    key, a, b = b"k", new_nonce(), new_nonce()
    proof = make_proof(key, "follower", rank=1, follower_nonce=a, root_nonce=b)
    assert verify_proof(key, "follower", proof, rank=1, follower_nonce=a, root_nonce=b)
    assert not verify_proof(b"K", "follower", proof, rank=1, follower_nonce=a, root_nonce=b)
    assert not verify_proof(key, "root", proof, rank=1, follower_nonce=a, root_nonce=b)
    assert not verify_proof(key, "follower", proof, rank=2, follower_nonce=a, root_nonce=b)
    assert not verify_proof(key, "follower", proof, rank=1, follower_nonce=b, root_nonce=a)
    assert secret_bytes("s", insecure=False, rank=0) == b"s"
    assert secret_bytes(None, insecure=True, rank=0) == b""
