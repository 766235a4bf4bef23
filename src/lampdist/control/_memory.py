"""The in-process control channel: anyio memory object streams, for one process that drives
several devices, and for tests."""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import ClassVar, NoReturn

import anyio
import anyio.lowlevel
import attrs
from anyio.abc import ObjectSendStream

from .._clique_id import CliqueId
from .._errors import (
    ConfigError,
    ControlError,
    JoinRejected,
    JoinTimeout,
    LampdistError,
    PeerDisconnected,
    Phase,
    RankFailed,
)
from ._bookkeeping import CommandRelay, FollowerState, RootRegistry, copy_error
from ._command import Command, CommandKind
from ._lifecycle import ChannelLifecycle, aclose_shielded
from ._protocols import (
    DEFAULT_JOIN_TIMEOUT,
    USE_CHANNEL_DEFAULT,
    FollowerChannel,
    RootChannel,
    UseChannelDefault,
    resolve_timeout,
)

__all__ = ["LocalFollowerChannel", "LocalRootChannel", "local_channels"]

logger = logging.getLogger(__name__)


@attrs.define(eq=False)
class _Hub:
    """What the root and the followers of one in-process channel share."""

    registry: RootRegistry
    root_closed: bool = False
    relays: dict[int, CommandRelay] = attrs.field(factory=dict)


@attrs.define(eq=False)
class LocalRootChannel(ChannelLifecycle):
    """The root side of :func:`local_channels`; see :class:`RootChannel`."""

    _RUNS_TASKS: ClassVar[bool] = False

    _hub: _Hub

    @property
    def nranks(self) -> int:
        """The number of ranks of the run, the root included."""
        return self._hub.registry.nranks

    def _identity(self) -> tuple[str, int]:
        return "the root channel", 0

    def _closing(self) -> None:
        hub = self._hub
        hub.root_closed = True
        hub.registry.closed = True
        for relay in hub.relays.values():
            relay.end()
        hub.registry.changed.notify()

    async def publish_clique_id(self, clique_id: CliqueId) -> None:
        """See :meth:`RootChannel.publish_clique_id`."""
        self._check_open("publish")
        await anyio.lowlevel.checkpoint()
        self._hub.registry.publish(clique_id)

    async def peers(self) -> int:
        """See :meth:`RootChannel.peers`."""
        await anyio.lowlevel.checkpoint()
        return len(self._hub.registry.live)

    async def wait_for_peers(self, n: int, timeout: float | None) -> None:  # noqa: ASYNC109
        """See :meth:`RootChannel.wait_for_peers`."""
        self._check_open("join")
        await self._hub.registry.wait_for_peers(n, timeout)

    async def broadcast(
        self,
        command: Command,
        *,
        timeout: float | UseChannelDefault | None = USE_CHANNEL_DEFAULT,  # noqa: ASYNC109
    ) -> None:
        """See :meth:`RootChannel.broadcast`; in process, delivery is immediate."""
        self._check_open("broadcast")
        resolve_timeout(timeout, None, rank=0, phase="broadcast")
        registry = self._hub.registry
        registry.check_broadcast(command)
        errors: list[LampdistError] = []
        for rank in sorted(registry.joined):
            failure = registry.failures.get(rank)
            if failure is not None:
                errors.append(copy_error(failure))
                continue
            try:
                self._hub.relays[rank].put(command)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                error = PeerDisconnected(
                    "the follower's channel is closed", rank=rank, phase="broadcast"
                )
                registry.fail(rank, error)
                errors.append(copy_error(error))
            else:
                if command.kind is CommandKind.STOP:
                    registry.mark_stopped(rank)
        await anyio.lowlevel.checkpoint()
        if errors:
            for extra in errors[1:]:
                logger.log(
                    self._hub.registry.failure_level,
                    "broadcast of %s: also %s",
                    command.kind.name,
                    extra,
                )
            raise errors[0]

    async def wait_until_left(self, ranks: Collection[int], timeout: float) -> None:  # noqa: ASYNC109
        """See :meth:`RootChannel.wait_until_left`: returns at once, as the followers are
        tasks of this process, which has no order of exits to keep (and whose channels may
        close only after the root has returned)."""
        await anyio.lowlevel.checkpoint()

    async def watch(self) -> NoReturn:
        """See :meth:`RootChannel.watch`."""
        await self._hub.registry.watch()


@attrs.define(eq=False)
class LocalFollowerChannel(ChannelLifecycle):
    """A follower side of :func:`local_channels`; see :class:`FollowerChannel`."""

    rank: int
    _hub: _Hub
    _join_timeout: float | None
    _follower: FollowerState = attrs.field(init=False)
    _relay: CommandRelay | None = None
    _commands: ObjectSendStream[Command] | None = None
    _joined: bool = False

    def __attrs_post_init__(self) -> None:
        self._follower = FollowerState(rank=self.rank)

    def _identity(self) -> tuple[str, int]:
        return f"the channel of rank {self.rank}", self.rank

    def _closing(self) -> None:
        if self._joined:  # a leave after STOP is a clean one
            self._hub.registry.fail(
                self.rank,
                PeerDisconnected(
                    "the follower's channel closed without STOP",
                    rank=self.rank,
                    phase=self._hub.registry.phase,
                ),
            )

    async def _closed(self) -> None:
        if self._relay is not None:
            self._relay.shut = True
        await aclose_shielded(self._commands)

    async def join(
        self,
        commands: ObjectSendStream[Command],
        *,
        timeout: float | UseChannelDefault | None = USE_CHANNEL_DEFAULT,  # noqa: ASYNC109
    ) -> CliqueId:
        """See :meth:`FollowerChannel.join`."""
        self._check_open("join")
        if self._joined:
            raise ControlError("join() was already called", rank=self.rank, phase="join")
        limit = resolve_timeout(timeout, self._join_timeout, rank=self.rank, phase="join")
        await anyio.lowlevel.checkpoint()
        hub, registry = self._hub, self._hub.registry
        reason = registry.admission_error(self.rank)
        if reason is not None:
            raise JoinRejected(reason, rank=self.rank, phase="join")
        relay = CommandRelay(self._follower, commands)
        hub.relays[self.rank] = relay
        self._relay, self._commands, self._joined = relay, commands, True
        registry.admit(self.rank)
        assert self._task_group is not None  # set by __aenter__
        self._task_group.start_soon(relay.run)
        with anyio.move_on_after(limit):
            while registry.clique_id is None:
                if hub.root_closed:
                    raise JoinRejected(
                        "the root closed before publishing the clique id",
                        rank=self.rank,
                        phase="join",
                    )
                await registry.changed.wait()
            return registry.clique_id
        raise JoinTimeout(
            f"joined, but the root published no clique id within {limit} s",
            rank=self.rank,
            phase="join",
        )

    async def report_failure(self, phase: Phase, message: str) -> None:
        """See :meth:`FollowerChannel.report_failure`."""
        await anyio.lowlevel.checkpoint()
        self._follower.reported = True
        if self._joined:
            error = RankFailed(message, rank=self.rank, phase=phase)
            self._hub.registry.fail(self.rank, error, reported=True)

    async def wait_until_root_left(self, timeout: float) -> None:  # noqa: ASYNC109
        """See :meth:`FollowerChannel.wait_until_root_left`: returns at once, as the root is
        a task of this process."""
        await anyio.lowlevel.checkpoint()

    async def watch(self) -> NoReturn:
        """See :meth:`FollowerChannel.watch`."""
        await self._follower.watch()


def local_channels(
    nranks: int, *, join_timeout: float | None = DEFAULT_JOIN_TIMEOUT
) -> tuple[RootChannel, list[FollowerChannel]]:
    """An in-process control channel for ``nranks`` ranks: the root side, and the follower
    sides of ranks 1..nranks-1 (index ``i`` is rank ``i + 1``).

    Use it to drive several devices from one process, and in tests. It behaves like the TCP
    channel where that applies: a follower channel that closes without STOP counts as
    disconnected for the root's :meth:`~RootChannel.watch` and
    :meth:`~RootChannel.broadcast`, and a root that closes without STOP makes the followers'
    :meth:`~FollowerChannel.watch` raise. ``join_timeout`` is the default timeout of
    :meth:`~FollowerChannel.join`. Raises :class:`lampdist.ConfigError` for ``nranks < 1``.
    """
    if not isinstance(nranks, int) or isinstance(nranks, bool) or nranks < 1:
        raise ConfigError(
            f"nranks must be an integer >= 1, got {nranks!r}", rank=0, phase="configure"
        )
    resolve_timeout(join_timeout, None, rank=0, phase="configure")
    hub = _Hub(registry=RootRegistry(nranks=nranks))
    root = LocalRootChannel(hub)
    followers: list[FollowerChannel] = [
        LocalFollowerChannel(rank=rank, hub=hub, join_timeout=join_timeout)
        for rank in range(1, nranks)
    ]
    return root, followers
