"""What the TCP root lets in before a peer has authenticated, and how loudly it says no.

A stranger can open connections faster than a handshake deadline ends them. Unbounded, each
would hold a file descriptor and a task for ``handshake_timeout`` seconds, and a flood would
run the root out of descriptors. So:

- :class:`Admission` bounds the connections in their handshake: :data:`MAX_UNAUTHENTICATED`
  in all and :data:`MAX_UNAUTHENTICATED_PER_HOST` from one address, each plus one per follower
  of the run (a run's own followers, all joining at once, always fit). A connection over a
  bound is closed as soon as it is accepted.
- :class:`ThrottledWarnings` writes at most one WARNING line per kind of refusal every
  :data:`WARNING_INTERVAL` seconds; the refusals held back are counted into the kind's next
  line, so a scan of ten thousand connections costs a handful of lines, not ten thousand.
- :func:`accept_retry_delay` tells the errors of ``accept`` that pass (out of descriptors or
  memory, a connection that died in the queue) from those that end the listener.
"""

from __future__ import annotations

import errno
import logging
from typing import Final, Literal, TypeAlias

import anyio
import attrs

__all__ = [
    "FIRST_ACCEPT_RETRY_DELAY",
    "MAX_ACCEPT_RETRY_DELAY",
    "MAX_UNAUTHENTICATED",
    "MAX_UNAUTHENTICATED_PER_HOST",
    "WARNING_INTERVAL",
    "Admission",
    "Refusal",
    "ThrottledWarnings",
    "WarningKind",
    "accept_retry_delay",
    "os_error_of",
]

MAX_UNAUTHENTICATED: Final = 64
"""Connections in their handshake at once, beyond one per follower of the run."""
MAX_UNAUTHENTICATED_PER_HOST: Final = 16
"""Connections in their handshake at once from one address, beyond one per follower."""
WARNING_INTERVAL: Final = 10.0
"""Seconds between two WARNING lines of one kind."""
FIRST_ACCEPT_RETRY_DELAY: Final = 0.01
"""Seconds before ``accept`` is tried again after the process ran out of a resource."""
MAX_ACCEPT_RETRY_DELAY: Final = 1.0
"""The longest wait between two tries of ``accept`` (the delay doubles up to it)."""

_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
"""``accept`` failed for want of descriptors or memory: wait, some are given back."""
_CONNECTION_GONE = frozenset(
    getattr(errno, name)
    for name in (
        "ECONNABORTED",
        "EPROTO",
        "ENETDOWN",
        "ENOPROTOOPT",
        "EHOSTDOWN",
        "ENONET",
        "EHOSTUNREACH",
        "EOPNOTSUPP",
        "ENETUNREACH",
        "EPERM",
    )
    if hasattr(errno, name)
)
"""``accept`` failed for the connection it was taking, which died in the queue (Linux's
accept(2) reports such errors of the new connection; its manual says to retry at once)."""

WarningKind: TypeAlias = Literal[
    "busy", "busy host", "timeout", "broken", "auth", "join", "mismatch", "protocol", "accept"
]
"""What a throttled WARNING line is about: a refusal, or ``accept`` failing."""

_MORE: Final[dict[WarningKind, str]] = {
    "busy": "refused {n} more control connections in the last {s} s: too many in their handshake",
    "busy host": "refused {n} more control connections in the last {s} s: too many in their "
    "handshake from one address",
    "timeout": "closed {n} more control connections in the last {s} s: no complete handshake "
    "in time",
    "broken": "{n} more control connections broke in the handshake in the last {s} s",
    "auth": "refused {n} more control connections in the last {s} s: authentication failed",
    "join": "refused {n} more joins in the last {s} s",
    "mismatch": "refused {n} more control connections in the last {s} s: settings that differ",
    "protocol": "refused {n} more control connections in the last {s} s: protocol errors",
    "accept": "accepting a control connection failed {n} more times in the last {s} s",
}


@attrs.frozen(kw_only=True)
class Refusal:
    """Why a connection is over a bound of :class:`Admission`."""

    kind: Literal["busy", "busy host"]
    reason: str


@attrs.define(eq=False)
class Admission:
    """The connections in their handshake, in all and by source address.

    Invariant: ``by_host`` sums to ``pending`` and holds no zero, so it has at most
    ``limit`` entries.
    """

    limit: int
    per_host_limit: int
    pending: int = 0
    by_host: dict[str, int] = attrs.field(factory=dict)

    @classmethod
    def for_run(cls, nranks: int) -> Admission:
        """The bounds of a run of ``nranks`` ranks: the defaults, plus one per follower."""
        followers = max(0, nranks - 1)
        return cls(
            limit=MAX_UNAUTHENTICATED + followers,
            per_host_limit=MAX_UNAUTHENTICATED_PER_HOST + followers,
        )

    def enter(self, host: str) -> Refusal | None:
        """Count in a new connection from ``host``, or say which bound it is over (then
        nothing is counted: the caller closes it)."""
        if self.pending >= self.limit:
            return Refusal(
                kind="busy",
                reason=f"{self.pending} connections are in their handshake, as many as the "
                "root lets in at once",
            )
        held = self.by_host.get(host, 0)
        if held >= self.per_host_limit:
            return Refusal(
                kind="busy host",
                reason=f"{held} connections from {host} are in their handshake, as many as "
                "the root lets in from one address",
            )
        self.pending += 1
        self.by_host[host] = held + 1
        return None

    def leave(self, host: str) -> None:
        """A connection counted in by :meth:`enter` has authenticated or ended."""
        self.pending -= 1
        held = self.by_host[host] - 1
        if held:
            self.by_host[host] = held
        else:
            del self.by_host[host]


@attrs.define(eq=False)
class _Tally:
    """One kind's lines: when the next may be written, and what was held back since."""

    quiet_until: float
    since: float
    held_back: int = 0
    latest: str = ""


@attrs.define(eq=False)
class ThrottledWarnings:
    """WARNING lines at most one per kind every ``interval`` seconds: the first of a kind is
    written at once, the next ones of the interval are counted, and the count goes out
    with the latest of them when the interval is over (at the kind's next line, or at
    :meth:`flush`)."""

    logger: logging.Logger
    interval: float = attrs.field(factory=lambda: WARNING_INTERVAL)
    _tallies: dict[WarningKind, _Tally] = attrs.field(factory=dict)

    def warn(self, kind: WarningKind, line: str) -> None:
        """Write ``line``, or count it into the kind's next line."""
        now = anyio.current_time()
        tally = self._tallies.get(kind)
        if tally is None or now >= tally.quiet_until:
            if tally is not None and tally.held_back:
                tally.held_back += 1
                tally.latest = line
                self._summarise(kind, tally, now)
                return
            self.logger.warning("%s", line, extra={"rank": 0})
            self._tallies[kind] = _Tally(quiet_until=now + self.interval, since=now)
            return
        tally.held_back += 1
        tally.latest = line

    def flush(self, *, every: bool = False) -> None:
        """Write the counts of the kinds whose interval is over (``every``: of all kinds, as
        the channel closes, so that no refusal goes untold)."""
        now = anyio.current_time()
        for kind, tally in self._tallies.items():
            if tally.held_back and (every or now >= tally.quiet_until):
                self._summarise(kind, tally, now)

    def _summarise(self, kind: WarningKind, tally: _Tally, now: float) -> None:
        more = _MORE[kind].format(n=tally.held_back, s=f"{now - tally.since:.1f}")
        self.logger.warning("%s; the latest: %s", more, tally.latest, extra={"rank": 0})
        tally.held_back, tally.latest = 0, ""
        tally.since, tally.quiet_until = now, now + self.interval


def os_error_of(error: BaseException) -> OSError | None:
    """The OS error behind an error of ``accept`` (trio's comes wrapped in anyio's
    ``BrokenResourceError``), or None."""
    if isinstance(error, OSError):
        return error
    cause = error.__cause__
    return cause if isinstance(cause, OSError) else None


def accept_retry_delay(error: OSError, backoff: float) -> float | None:
    """How long to wait before trying ``accept`` again after ``error``: ``backoff`` when the
    process ran out of descriptors or memory, 0 when the connection died in the queue, None
    when the listener itself failed."""
    if error.errno in _OUT_OF_RESOURCES:
        return backoff
    if error.errno in _CONNECTION_GONE:
        return 0.0
    return None
