"""The two sides of the control channel, as protocols; the in-process and the TCP channels
implement them with the same semantics.

The ``timeout`` parameters are part of the public contract (hence ``noqa: ASYNC109``):
a deadline on a peer, with :data:`USE_CHANNEL_DEFAULT` meaning the channel's own setting.

Errors (every one names the rank it concerns and the phase):

- :class:`lampdist.JoinTimeout` (a ``TimeoutError``): a follower could not join in time, or
  the root's :meth:`RootChannel.wait_for_peers` ran out; the message lists the missing ranks.
- :class:`lampdist.JoinRejected`: the root refused the follower (duplicate rank, rank out of
  range, the run already stopped, the root closed before publishing the clique id).
- :class:`lampdist.AuthenticationError`: the shared secrets differ (TCP only).
- :class:`lampdist.PeerDisconnected`: the peer closed its channel without STOP, or its
  heartbeats stopped (``rank`` is the vanished peer: 0 on followers).
- :class:`lampdist.RankFailed`: a follower reported a failure (``rank`` and ``phase`` are the
  follower's).
- :class:`lampdist.LampdistTimeout`: a follower did not acknowledge a command in time.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from types import TracebackType
from typing import Final, NoReturn, Protocol, Self, runtime_checkable

from anyio.abc import ObjectSendStream

from .._clique_id import CliqueId
from .._defaults import JOIN_TIMEOUT
from .._errors import ConfigError, LampdistError, Phase
from ._command import Command

__all__ = [
    "DEFAULT_BROADCAST_TIMEOUT",
    "DEFAULT_JOIN_TIMEOUT",
    "USE_CHANNEL_DEFAULT",
    "FollowerChannel",
    "RecoverableRootChannel",
    "RootChannel",
    "UseChannelDefault",
    "resolve_timeout",
]

#: How long a follower waits in :meth:`FollowerChannel.join` unless told otherwise (the
#: default of ``lampdist.Timeouts.join``).
DEFAULT_JOIN_TIMEOUT: Final = JOIN_TIMEOUT
#: How long :meth:`RootChannel.broadcast` waits for every follower's acknowledgement.
DEFAULT_BROADCAST_TIMEOUT: Final = 60.0


class UseChannelDefault(enum.Enum):
    """The type of :data:`USE_CHANNEL_DEFAULT`: "use the timeout the channel was opened with"."""

    USE_CHANNEL_DEFAULT = "use-channel-default"


#: Default of ``timeout`` parameters: the timeout the channel was created with.
USE_CHANNEL_DEFAULT: Final = UseChannelDefault.USE_CHANNEL_DEFAULT


def resolve_timeout(
    timeout: float | UseChannelDefault | None, default: float | None, *, rank: int, phase: Phase
) -> float | None:
    """``timeout``, or ``default`` for :data:`USE_CHANNEL_DEFAULT`; refuses negative values."""
    if isinstance(timeout, UseChannelDefault):
        return default
    if timeout is not None and not timeout >= 0:
        raise ConfigError(
            f"a timeout must be >= 0 or None, got {timeout!r}", rank=rank, phase=phase
        )
    return timeout


class RootChannel(Protocol):
    """The root's side of the control channel (rank 0).

    An async context manager that owns its background tasks: enter it before anything else,
    and leave it last. Leaving it without having broadcast STOP counts as the root vanishing
    for every follower. Its ``__aexit__`` may raise an ``ExceptionGroup`` only for a bug in a
    background task; peer failures surface through :meth:`watch` and :meth:`broadcast`.
    """

    @property
    def nranks(self) -> int:
        """The number of ranks of the run, the root included."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None: ...

    async def publish_clique_id(self, clique_id: CliqueId) -> None:
        """Give every follower the clique id: those that joined already get it now, later
        ones when they join. Call it once (again with the same id is a no-op).

        Raises :class:`lampdist.MismatchError` if ``clique_id.nranks`` differs from
        :attr:`nranks`, :class:`lampdist.ConfigError` for a second, different id.
        """
        ...

    async def peers(self) -> int:
        """How many followers have joined and not failed or left."""
        ...

    async def wait_for_peers(self, n: int, timeout: float | None) -> None:  # noqa: ASYNC109
        """Wait until ``n`` followers have joined (``timeout`` seconds, None = no limit).

        Raises :class:`lampdist.JoinTimeout` naming the missing ranks, or the failure of a
        follower that failed while waiting (a failed rank cannot join again).
        """
        ...

    async def broadcast(
        self,
        command: Command,
        *,
        timeout: float | UseChannelDefault | None = USE_CHANNEL_DEFAULT,  # noqa: ASYNC109
    ) -> None:
        """Deliver ``command`` to every follower that joined, in order, and wait until each
        holds it (TCP: has acknowledged it, within ``timeout``).

        Never drops a command silently: every live follower gets it, then the failure of any
        follower that is gone or failed is raised (:class:`lampdist.PeerDisconnected`,
        :class:`lampdist.RankFailed`, :class:`lampdist.LampdistTimeout` for a missing
        acknowledgement), so a STOP carrying an error still reaches the survivors. Publish
        the clique id first; nothing follows STOP (:class:`lampdist.ControlError`).
        """
        ...

    async def wait_until_left(self, ranks: Collection[int], timeout: float) -> None:  # noqa: ASYNC109
        """Wait until the followers ``ranks`` have closed their channels, for at most
        ``timeout`` seconds; never raises on the timeout.

        The root awaits it after a follower reported a failure of its own, so that the failed
        rank's process ends before the root's: a launcher that names the first process to
        fail (torchrun's "Root Cause") then names the rank that failed, not the root. The
        in-process channel returns at once: its followers are tasks of the root's process.
        """
        ...

    async def watch(self) -> NoReturn:
        """Wait until a follower fails, then raise its error.

        :class:`lampdist.PeerDisconnected` for a follower that closed its channel without
        STOP or whose heartbeats stopped, :class:`lampdist.RankFailed` for one that reported
        a failure. A follower that leaves after it received STOP is no failure. Run it in a
        task group beside the training work so that a dead follower cancels the root.
        """
        ...


@runtime_checkable
class RecoverableRootChannel(RootChannel, Protocol):
    """A root channel whose lost followers can be replaced, which the root's recovery needs
    (see :class:`lampdist.Recovery`); the TCP channel is one. The in-process channel is not:
    its followers are tasks of the root's process.
    """

    async def lost_followers(self) -> dict[int, LampdistError]:
        """The followers that failed or left without STOP, by rank, with their errors (as
        :meth:`watch` would raise them); empty while every follower is well."""
        ...

    async def forget(self, ranks: Collection[int]) -> None:
        """Begin the clique's next generation without the followers ``ranks`` (the root's
        recovery of lost ranks, see :class:`lampdist.Recovery`): close their connections if
        any are still open, forget their failures, and let new processes join as them; the
        clique id is withdrawn, and joiners wait for the next :meth:`publish_clique_id`.
        """
        ...


class FollowerChannel(Protocol):
    """A follower's side of the control channel (rank >= 1).

    An async context manager that owns its background tasks. Leaving it before STOP arrived
    counts as this follower vanishing for the root.
    """

    @property
    def rank(self) -> int:
        """This follower's rank (1..nranks-1)."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None: ...

    async def join(
        self,
        commands: ObjectSendStream[Command],
        *,
        timeout: float | UseChannelDefault | None = USE_CHANNEL_DEFAULT,  # noqa: ASYNC109
    ) -> CliqueId:
        """Register with the root and return the clique id (waiting for it if the root has
        not published it yet).

        When it returns this follower is registered: every command broadcast afterwards
        arrives on ``commands``, in order. The channel owns ``commands`` from then on and
        closes it after STOP, when the root vanishes (then :meth:`watch` raises why) and when
        the channel closes. Raises :class:`lampdist.JoinTimeout`,
        :class:`lampdist.JoinRejected`, :class:`lampdist.AuthenticationError`.
        """
        ...

    async def report_failure(self, phase: Phase, message: str) -> None:
        """Tell the root that this rank failed in ``phase``, so that its :meth:`RootChannel.watch`
        raises :class:`lampdist.RankFailed`. Best effort and bounded (about a second); never
        raises for a broken channel."""
        ...

    async def wait_until_root_left(self, timeout: float) -> None:  # noqa: ASYNC109
        """Wait until the root has closed its channel and its process has had a moment to end,
        for at most ``timeout`` seconds; never raises on the timeout.

        A follower awaits it after the root stopped the run with an error of its own, so that
        the root's process ends before the follower's: a launcher that names the first
        process to fail (torchrun's "Root Cause") then names the root, and does not end it
        with a signal. The in-process channel returns at once.
        """
        ...

    async def watch(self) -> NoReturn:
        """Wait until the root vanishes, then raise :class:`lampdist.PeerDisconnected`
        (``rank=0``): it closed its channel without STOP, or its heartbeats stopped. After
        STOP arrived it never raises: it waits until cancelled."""
        ...
