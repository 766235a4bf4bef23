"""Settings shared by both ends of the TCP control channel, checked once, and the liveness
bookkeeping of a connection."""

from __future__ import annotations

import math
import ssl

import anyio
import attrs

from .._errors import ConfigError
from ._wire import MIN_MAX_FRAME_BYTES

__all__ = [
    "DEFAULT_HANDSHAKE_TIMEOUT",
    "DEFAULT_HEARTBEAT_INTERVAL",
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "Liveness",
    "TcpSettings",
    "check_settings",
]

DEFAULT_HEARTBEAT_INTERVAL = 1.0
DEFAULT_HEARTBEAT_TIMEOUT = 5.0
DEFAULT_HANDSHAKE_TIMEOUT = 5.0


@attrs.frozen(kw_only=True)
class TcpSettings:
    """Checked settings of one end of a TCP control channel."""

    ssl_context: ssl.SSLContext | None
    heartbeat_interval: float
    heartbeat_timeout: float
    handshake_timeout: float
    max_frame_bytes: int


def _positive(name: str, value: object, rank: int) -> float:
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}", rank=rank)
    return float(value)


def check_settings(
    *,
    rank: int,
    ssl_context: ssl.SSLContext | None,
    heartbeat_interval: float,
    heartbeat_timeout: float,
    handshake_timeout: float,
    max_frame_bytes: int,
) -> TcpSettings:
    """Validated settings; raises :class:`lampdist.ConfigError` saying what to pass instead."""
    interval = _positive("heartbeat_interval", heartbeat_interval, rank)
    timeout = _positive("heartbeat_timeout", heartbeat_timeout, rank)
    if not interval < timeout:
        raise ConfigError(
            f"heartbeat_interval ({interval} s) must be below heartbeat_timeout ({timeout} s); "
            "a timeout of 3 to 5 intervals is usual",
            rank=rank,
        )
    if ssl_context is not None and not isinstance(ssl_context, ssl.SSLContext):
        raise ConfigError(f"ssl_context must be an ssl.SSLContext, got {ssl_context!r}", rank=rank)
    if (
        not isinstance(max_frame_bytes, int)
        or isinstance(max_frame_bytes, bool)
        or max_frame_bytes < MIN_MAX_FRAME_BYTES
    ):
        raise ConfigError(
            f"max_frame_bytes must be an integer >= {MIN_MAX_FRAME_BYTES}, got {max_frame_bytes!r}",
            rank=rank,
        )
    return TcpSettings(
        ssl_context=ssl_context,
        heartbeat_interval=interval,
        heartbeat_timeout=timeout,
        handshake_timeout=_positive("handshake_timeout", handshake_timeout, rank),
        max_frame_bytes=max_frame_bytes,
    )


@attrs.define(eq=False)
class Liveness:
    """When the peer was last heard from, and since when a send has been stuck.

    The readers and writers only stamp times (no cancel scope per frame, which would cost
    more than the frame); a watchdog looks every heartbeat interval with :meth:`problem`.
    """

    timeout: float
    last_heard: float = attrs.field(factory=anyio.current_time)
    sending_since: float | None = None

    def heard(self) -> None:
        self.last_heard = anyio.current_time()

    def stalled_here(self, since: float) -> str | None:
        """Why this process itself counts as lost, when a watchdog that went to sleep at
        ``since`` (``anyio.current_time()``) woke more than ``timeout`` seconds later: the
        process did not run meanwhile (it was stopped, or starved of CPU), so the peer has
        given up on it, and its silence is not the peer's fault."""
        slept = anyio.current_time() - since
        if slept <= self.timeout:
            return None
        return (
            f"this process did not run for {slept:.1f} s (stopped, or starved of CPU), longer "
            f"than heartbeat_timeout={self.timeout} s"
        )

    def problem(self) -> str | None:
        """Why the peer counts as lost now, or None."""
        now = anyio.current_time()
        silent = now - self.last_heard
        if silent > self.timeout:
            return f"no heartbeat for {silent:.1f} s (heartbeat_timeout={self.timeout} s)"
        if self.sending_since is not None and now - self.sending_since > self.timeout:
            stuck = now - self.sending_since
            return f"a send has been stuck for {stuck:.1f} s: the peer does not read"
        return None
