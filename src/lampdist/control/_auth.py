"""Mutual authentication with a shared secret: HMAC-SHA256 challenge-response both ways.

Each side sends a fresh random nonce; each proves that it holds the secret by sending the HMAC
of the transcript (protocol version, its role, the follower's rank and both nonces). The secret
itself never crosses the wire, a proof cannot be replayed on another connection (fresh nonces),
nor reflected to the other role (the role is in the transcript).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Literal

from .._errors import ConfigError
from ._wire import NONCE_BYTES, PROTOCOL_VERSION

__all__ = ["make_proof", "new_nonce", "secret_bytes", "verify_proof"]

Role = Literal["root", "follower"]


def secret_bytes(secret: str | bytes | None, *, insecure: bool, rank: int) -> bytes:
    """The key for ``secret``; raises :class:`lampdist.ConfigError` without one unless
    ``insecure`` (then both sides must run without a secret)."""
    if secret is None:
        if not insecure:
            raise ConfigError(
                "the TCP control channel needs a shared secret: pass secret=... (the same on "
                "every rank, e.g. from an environment variable), or insecure=True on a "
                "trusted network",
                rank=rank,
                phase="configure",
            )
        return b""
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes) or not secret:
        raise ConfigError("secret must be a non-empty str or bytes", rank=rank, phase="configure")
    return secret


def new_nonce() -> bytes:
    """A fresh random nonce."""
    return secrets.token_bytes(NONCE_BYTES)


def make_proof(
    key: bytes, role: Role, *, rank: int, follower_nonce: bytes, root_nonce: bytes
) -> bytes:
    """The HMAC proof of ``role`` over the handshake transcript."""
    transcript = b"|".join(
        [
            b"lampdist-control",
            str(PROTOCOL_VERSION).encode(),
            role.encode(),
            str(rank).encode(),
            follower_nonce,
            root_nonce,
        ]
    )
    return hmac.new(key, transcript, hashlib.sha256).digest()


def verify_proof(
    key: bytes, role: Role, proof: bytes, *, rank: int, follower_nonce: bytes, root_nonce: bytes
) -> bool:
    """Whether ``proof`` is ``role``'s proof for this transcript (constant-time compare)."""
    expected = make_proof(
        key, role, rank=rank, follower_nonce=follower_nonce, root_nonce=root_nonce
    )
    return hmac.compare_digest(expected, proof)
