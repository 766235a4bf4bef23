"""Bookkeeping shared by the in-process and the TCP channels: who joined, who failed, who
stopped, on the root; whether the root vanished, on a follower."""

from __future__ import annotations

import enum
import logging
from typing import NoReturn

import anyio
import anyio.lowlevel
import attrs
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from .._errors import (
    ConfigError,
    ControlError,
    JoinTimeout,
    LampdistError,
    PeerDisconnected,
)
from ._command import Command, CommandKind

__all__ = ["ChannelState", "FollowerState", "Notifier", "RootRegistry", "copy_error"]

logger = logging.getLogger(__name__)

#: Bound on shielded cleanup (closing streams) so that it cannot wedge a rank.
CLOSE_TIMEOUT = 5.0


class ChannelState(enum.Enum):
    """Guards ``__aenter__`` against reuse."""

    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


def copy_error(error: LampdistError) -> LampdistError:
    """A fresh exception equal to ``error`` (raising one instance twice tangles tracebacks)."""
    return type(error)(error.message, rank=error.rank, phase=error.phase)


def check_enter(state: ChannelState, what: str, rank: int) -> None:
    """Refuse to enter a channel twice."""
    if state is not ChannelState.NEW:
        raise ControlError(
            f"{what} can be entered only once; create a new channel", rank=rank, phase="open"
        )


def check_open(state: ChannelState, what: str, rank: int, phase: str) -> None:
    """Refuse calls outside ``async with``."""
    if state is not ChannelState.OPEN:
        raise ControlError(
            f"{what} is {state.value}: use it inside 'async with'", rank=rank, phase=phase
        )


@attrs.define(eq=False)
class Notifier:
    """Wakes every waiter at the next :meth:`notify` (a condition variable without a lock).

    Its event is made lazily, so that channels can be created outside an event loop.
    """

    _event: anyio.Event | None = None

    def notify(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self) -> None:
        if self._event is None:
            self._event = anyio.Event()
        await self._event.wait()


@attrs.define(eq=False)
class RootRegistry:
    """The root's view of its followers."""

    nranks: int
    phase: str = "join"
    closed: bool = False
    stop_sent: bool = False
    clique_published: bool = False
    joined: set[int] = attrs.field(factory=set)
    live: set[int] = attrs.field(factory=set)
    stopped: set[int] = attrs.field(factory=set)
    failures: dict[int, LampdistError] = attrs.field(factory=dict)
    first_failure: LampdistError | None = None
    changed: Notifier = attrs.field(factory=Notifier)

    def admission_error(self, rank: int) -> str | None:
        """Why ``rank`` may not join now, or None."""
        if self.closed:
            return "the root is closing; start a new run"
        if self.stop_sent:
            return "the run has already stopped"
        if not 1 <= rank < self.nranks:
            if self.nranks == 1:
                return f"rank {rank} cannot join: this run has no followers (nranks=1)"
            return (
                f"rank {rank} is out of range: this run has nranks={self.nranks}, so "
                f"followers are ranks 1..{self.nranks - 1}"
            )
        if rank in self.joined:
            return f"rank {rank} has already joined; give every follower its own rank"
        return None

    def admit(self, rank: int) -> None:
        """Register ``rank`` (after :meth:`admission_error` said None)."""
        self.joined.add(rank)
        self.live.add(rank)
        logger.info("rank %d joined the control channel", rank, extra={"rank": rank})
        self.changed.notify()

    def fail(self, rank: int, error: LampdistError, *, reported: bool = False) -> None:
        """Record that ``rank`` failed; a disconnect after STOP is a clean leave. The first
        failure of a rank sticks."""
        if rank in self.failures or self.closed:
            return
        self.live.discard(rank)
        if rank in self.stopped and not reported:
            logger.debug("rank %d left after STOP", rank, extra={"rank": rank})
        else:
            self.failures[rank] = error
            if self.first_failure is None:
                self.first_failure = error
            logger.warning("%s", error, extra={"rank": rank})
        self.changed.notify()

    def mark_stopped(self, rank: int) -> None:
        """``rank`` holds STOP: from now on its leaving is no failure."""
        self.stopped.add(rank)

    def check_broadcast(self, command: Command) -> None:
        """Refuse a broadcast before the clique id or after STOP."""
        if not self.clique_published:
            raise ControlError(
                "publish the clique id before broadcasting commands", rank=0, phase="broadcast"
            )
        if self.stop_sent:
            raise ControlError(
                f"cannot broadcast {command.kind.name}: STOP was already broadcast",
                rank=0,
                phase="broadcast",
            )
        self.phase = command.kind.value
        if command.kind is CommandKind.STOP:
            self.stop_sent = True

    async def wait_for_peers(self, n: int, timeout: float | None) -> None:  # noqa: ASYNC109
        """See :meth:`RootChannel.wait_for_peers`."""
        if not isinstance(n, int) or not 0 <= n < self.nranks:
            raise ConfigError(
                f"wait_for_peers needs 0 <= n <= {self.nranks - 1} (the number of followers), "
                f"got {n!r}",
                rank=0,
                phase="join",
            )
        await anyio.lowlevel.checkpoint()
        with anyio.move_on_after(timeout):
            while len(self.live) < n:
                if self.first_failure is not None:
                    raise copy_error(self.first_failure)
                await self.changed.wait()
            return
        missing = [rank for rank in range(1, self.nranks) if rank not in self.live]
        raise JoinTimeout(
            f"{len(self.live)} of {n} followers joined within {timeout} s; missing ranks "
            f"{missing} (are they running, with the right address and secret?)",
            rank=0,
            phase="join",
        )

    async def watch(self) -> NoReturn:
        """See :meth:`RootChannel.watch`."""
        while self.first_failure is None:
            await self.changed.wait()
        raise copy_error(self.first_failure)


@attrs.define(eq=False)
class FollowerState:
    """A follower's view of the root."""

    rank: int
    phase: str = "join"
    stopped: bool = False
    failure: LampdistError | None = None
    changed: Notifier = attrs.field(factory=Notifier)

    def root_lost(self, reason: str) -> None:
        """Record that the root vanished (ignored after STOP; the first reason sticks)."""
        if self.stopped or self.failure is not None:
            return
        self.failure = PeerDisconnected(reason, rank=0, phase=self.phase)
        logger.warning("rank %d: %s", self.rank, self.failure, extra={"rank": self.rank})
        self.changed.notify()

    async def watch(self) -> NoReturn:
        """See :meth:`FollowerChannel.watch`."""
        while self.failure is None:
            await self.changed.wait()
        raise copy_error(self.failure)

    async def forward(
        self, inbox: ObjectReceiveStream[Command], commands: ObjectSendStream[Command]
    ) -> None:
        """Move commands from the channel's inbox to the user's stream until STOP or the end
        of the inbox (the root vanished), then close the user's stream."""
        deliver = True
        try:
            async for command in inbox:
                self.phase = command.kind.value
                if command.kind is CommandKind.STOP:
                    self.stopped = True
                if deliver:
                    try:
                        await commands.send(command)
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                        deliver = False
                        logger.debug("rank %d: nobody reads the commands any more", self.rank)
                if self.stopped:
                    return
            self.root_lost("the root closed the control channel without STOP")
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT):
                await commands.aclose()
