"""Bookkeeping shared by the in-process and the TCP channels: who joined, who failed, who
stopped, on the root; whether the root vanished, on a follower."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection
from typing import NoReturn

import anyio
import anyio.lowlevel
import attrs
from anyio.abc import ObjectSendStream
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._clique_id import CliqueId
from .._errors import (
    ConfigError,
    ControlError,
    JoinTimeout,
    LampdistError,
    MismatchError,
    PeerDisconnected,
    PeerUnresponsive,
    Phase,
)
from ._command import Command, CommandKind
from ._lifecycle import aclose_shielded

__all__ = [
    "CommandRelay",
    "FollowerState",
    "Notifier",
    "RootRegistry",
    "Waiting",
    "copy_error",
]

logger = logging.getLogger(__name__)


def copy_error(error: LampdistError) -> LampdistError:
    """A fresh exception equal to ``error`` (raising one instance twice tangles tracebacks)."""
    return type(error)(error.message, rank=error.rank, phase=error.phase)


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

    async def raise_failure(self, failure: Callable[[], LampdistError | None]) -> NoReturn:
        """Wait until ``failure()`` returns an error, then raise a copy of it."""
        while (error := failure()) is None:
            await self.wait()
        raise copy_error(error)


@attrs.define(eq=False)
class RootRegistry:
    """The root's view of its followers."""

    nranks: int
    phase: Phase = "join"
    closed: bool = False
    stop_sent: bool = False
    clique_id: CliqueId | None = None
    """The published clique id (``None`` until :meth:`publish`)."""
    renewing: bool = False
    """Between :meth:`forget` and the next :meth:`publish`: the survivors hold the last
    generation's id and still take commands (HOLD)."""
    joined: set[int] = attrs.field(factory=set)
    live: set[int] = attrs.field(factory=set)
    stopped: set[int] = attrs.field(factory=set)
    failures: dict[int, LampdistError] = attrs.field(factory=dict)
    first_failure: LampdistError | None = None
    broken: LampdistError | None = None
    """Why the channel itself failed (the TCP root's listener), or None."""
    refusals: list[str] = attrs.field(factory=list)
    """Connections refused while joining, newest last (``"from HOST:PORT: reason"``); at most
    :data:`_REFUSALS_KEPT`."""
    left: set[int] = attrs.field(factory=set)
    """Followers whose connection (or in-process channel) has closed, for whatever reason."""
    changed: Notifier = attrs.field(factory=Notifier)

    def publish(self, clique_id: CliqueId) -> bool:
        """Record the clique id for every follower; ``False`` when this very id was published
        already (a no-op). Raises :class:`MismatchError` when ``clique_id.nranks`` differs
        from :attr:`nranks`, :class:`ConfigError` for a second, different id."""
        if clique_id.nranks != self.nranks:
            raise MismatchError(
                f"the clique id is for nranks={clique_id.nranks}, the channel for "
                f"nranks={self.nranks}",
                rank=0,
                phase="publish",
            )
        if self.clique_id is not None:
            if self.clique_id == clique_id:
                return False
            raise ConfigError(
                "a different clique id was already published", rank=0, phase="publish"
            )
        self.clique_id = clique_id
        self.renewing = False
        self.changed.notify()
        return True

    def lost_followers(self) -> dict[int, LampdistError]:
        """See :meth:`RootChannel.lost_followers`."""
        return {rank: copy_error(error) for rank, error in sorted(self.failures.items())}

    def forget(self, ranks: Collection[int]) -> None:
        """See :meth:`RootChannel.forget`: the ranks may join again, and the clique id is
        withdrawn until the next :meth:`publish`."""
        for rank in ranks:
            self.joined.discard(rank)
            self.live.discard(rank)
            self.stopped.discard(rank)
            self.left.discard(rank)
            self.failures.pop(rank, None)
        self.first_failure = next(iter(self.failures.values()), None)
        self.clique_id = None
        self.renewing = True
        self.changed.notify()

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

    def channel_failed(self, error: LampdistError) -> None:
        """Record that the channel itself failed: :meth:`watch` and :meth:`wait_for_peers`
        raise ``error`` from now on (the first such error sticks)."""
        if self.broken is None and not self.closed:
            self.broken = error
            self.changed.notify()

    def _failure(self) -> LampdistError | None:
        return self.broken if self.broken is not None else self.first_failure

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
            logger.log(self.failure_level, "%s", error, extra={"rank": rank})
        self.changed.notify()

    @property
    def failure_level(self) -> int:
        """How loud a follower's failure is: WARNING while the run goes on; INFO once the root
        has begun to broadcast STOP (the run is ending, a follower leaving is no news; the
        broadcast itself raises what went wrong)."""
        return logging.INFO if self.stop_sent else logging.WARNING

    def leave(self, rank: int) -> None:
        """Record that ``rank``'s connection closed (after :meth:`fail`, if it failed)."""
        self.left.add(rank)
        self.changed.notify()

    async def wait_until_left(self, ranks: Collection[int], timeout: float) -> None:  # noqa: ASYNC109
        """See :meth:`RootChannel.wait_until_left`."""
        with anyio.move_on_after(timeout):
            while not set(ranks) <= self.left:
                await self.changed.wait()

    def mark_stopped(self, rank: int) -> None:
        """``rank`` holds STOP: from now on its leaving is no failure."""
        self.stopped.add(rank)

    def check_broadcast(self, command: Command) -> None:
        """Refuse a broadcast before the clique id or after STOP."""
        if self.clique_id is None and not self.renewing:
            raise ControlError(
                "publish the clique id before broadcasting commands", rank=0, phase="broadcast"
            )
        if self.stop_sent:
            raise ControlError(
                f"cannot broadcast {command.kind.name}: STOP was already broadcast",
                rank=0,
                phase="broadcast",
            )
        self.phase = command.kind.phase
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
        waiting = Waiting(timeout)
        with anyio.move_on_after(timeout):
            while len(self.live) < n:
                if (failure := self._failure()) is not None:
                    raise copy_error(failure)
                with anyio.move_on_after(waiting.until_report()):
                    await self.changed.wait()
                if waiting.report_due():
                    logger.warning(
                        "waiting for followers: %s; %s", self._joined_so_far(n), waiting.left()
                    )
            return
        raise JoinTimeout(
            f"{self._joined_so_far(n)} within {timeout} s (are they running, with the right "
            "address and secret?)",
            rank=0,
            phase="join",
        )

    def refused(self, peer: str, reason: str) -> None:
        """Record a connection refused while the followers join."""
        self.refusals.append(f"from {peer}: {reason}")
        del self.refusals[:-_REFUSALS_KEPT]

    def _joined_so_far(self, n: int) -> str:
        missing = [rank for rank in range(1, self.nranks) if rank not in self.live]
        seen = f"{len(self.live)} of {n} followers joined; missing ranks {missing}"
        if self.refusals:
            seen += "; refused meanwhile: " + "; ".join(self.refusals)
        return seen

    async def watch(self) -> NoReturn:
        """See :meth:`RootChannel.watch`."""
        await self.changed.raise_failure(self._failure)


@attrs.define(eq=False)
class FollowerState:
    """A follower's view of the root."""

    rank: int
    phase: Phase = "join"
    stopped: bool = False
    reported: bool = False
    """Whether this follower reported a failure of its own: the root's going away is then
    the expected consequence, not news worth a warning."""
    failure: LampdistError | None = None
    changed: Notifier = attrs.field(factory=Notifier)

    def root_lost(self, reason: str, *, silent: bool = False, rank: int = 0) -> None:
        """Record that the root vanished, or with ``silent`` fell silent (or this follower,
        ``rank``, did: it was stopped); ignored after STOP; the first reason sticks."""
        if self.stopped or self.failure is not None:
            return
        kind = PeerUnresponsive if silent else PeerDisconnected
        self.failure = kind(reason, rank=rank, phase=self.phase)
        level = logging.DEBUG if self.reported else logging.WARNING
        logger.log(level, "rank %d: %s", self.rank, self.failure, extra={"rank": self.rank})
        self.changed.notify()

    async def watch(self) -> NoReturn:
        """See :meth:`FollowerChannel.watch`."""
        await self.changed.raise_failure(lambda: self.failure)


@attrs.define(eq=False)
class CommandRelay:
    """Hands commands to the user's stream in order without ever blocking the caller of
    :meth:`put` (a reader that must keep reading heartbeats, or the in-process root).

    When nothing is queued and the user's stream is a memory object stream with room, a
    command goes straight in; otherwise it waits in an unbounded queue (one command per pass:
    it stays short) for :meth:`run`. The user's stream is closed after STOP, and when the
    relay ends without STOP (the root vanished; :meth:`FollowerState.watch` says why).
    """

    follower: FollowerState
    commands: ObjectSendStream[Command]
    _queue_in: MemoryObjectSendStream[Command] = attrs.field(init=False)
    _queue_out: MemoryObjectReceiveStream[Command] = attrs.field(init=False)
    _queued: int = 0
    _deliver: bool = True
    shut: bool = False

    def __attrs_post_init__(self) -> None:
        self._queue_in, self._queue_out = anyio.create_memory_object_stream[Command](math.inf)

    def put(self, command: Command) -> None:
        """Pass ``command`` on; raises ``anyio.BrokenResourceError`` once the follower's
        channel has closed."""
        if self.shut:
            raise anyio.BrokenResourceError
        self.follower.phase = command.kind.phase
        stop = command.kind is CommandKind.STOP
        if stop:
            self.follower.stopped = True
        if self._queued == 0 and isinstance(self.commands, MemoryObjectSendStream):
            try:
                self.commands.send_nowait(command)
            except anyio.WouldBlock:
                pass
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._stop_delivering()
                if stop:
                    self.end()
                return
            else:
                if stop:
                    self.commands.close()
                    self.end()
                return
        self._queued += 1
        self._queue_in.send_nowait(command)

    def end(self) -> None:
        """No more commands will come: :meth:`run` finishes the queue and returns."""
        self._queue_in.close()

    def _stop_delivering(self) -> None:
        if self._deliver:
            self._deliver = False
            logger.debug("rank %d: nobody reads the commands any more", self.follower.rank)

    async def run(self) -> None:
        """Deliver queued commands until STOP or :meth:`end`, then close the user's stream."""
        try:
            async for command in self._queue_out:
                if self._deliver:
                    try:
                        await self.commands.send(command)
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                        self._stop_delivering()
                self._queued -= 1  # only now may put() deliver directly again
                if command.kind is CommandKind.STOP:
                    return
            self.follower.root_lost("the root closed the control channel without STOP")
        finally:
            self.shut = True
            await aclose_shielded(self.commands)


_REFUSALS_KEPT = 5
"""How many refused connections a join keeps to report."""

FIRST_REPORT = 10.0
"""Seconds of waiting for a peer before the first progress line."""

REPORT_EVERY = 20.0
"""Seconds between progress lines of a long wait for a peer."""


@attrs.define
class Waiting:
    """A wait for peers that reports its progress: first after :data:`FIRST_REPORT` s, then
    every :data:`REPORT_EVERY` s, with the time left of ``timeout`` (``None``: no limit)."""

    timeout: float | None
    started: float = attrs.field(factory=anyio.current_time)
    next_report: float = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.next_report = self.started + FIRST_REPORT

    def until_report(self) -> float:
        return max(0.0, self.next_report - anyio.current_time())

    def report_due(self) -> bool:
        """Whether a progress line is due now (and then the next one is scheduled)."""
        if anyio.current_time() < self.next_report:
            return False
        self.next_report = anyio.current_time() + REPORT_EVERY
        return True

    def left(self) -> str:
        waited = anyio.current_time() - self.started
        if self.timeout is None:
            return f"waited {waited:.0f} s (no time limit)"
        return f"{max(0.0, self.timeout - waited):.0f} s left of {self.timeout} s"
