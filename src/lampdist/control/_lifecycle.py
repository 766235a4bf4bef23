"""The one lifecycle of the control channels: entered once, a task group of their own, closed
through :meth:`ChannelLifecycle.aclose` as anyio's ``AsyncResource`` is.

A channel subclasses :class:`ChannelLifecycle` and writes only what is its own:

- :meth:`~ChannelLifecycle._identity`: how its errors name it, and the rank they carry;
- :meth:`~ChannelLifecycle._prepare`: what must succeed before its tasks start (the TCP root's
  listener); a failure leaves the channel closed;
- :meth:`~ChannelLifecycle._start_tasks`: the tasks it starts in its task group;
- :meth:`~ChannelLifecycle._closing`: its cleanup before its tasks are cancelled (the registry
  marked closed, a follower marked gone);
- :meth:`~ChannelLifecycle._closed`: its cleanup once its tasks have ended, on every path
  (streams closed, with :func:`aclose_shielded`).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import AsyncIterator
from types import TracebackType
from typing import ClassVar, Protocol, Self

import anyio
import attrs
from anyio.abc import TaskGroup

from .._errors import ControlError, Phase

__all__ = ["CLOSE_TIMEOUT", "ChannelLifecycle", "ChannelState", "aclose_shielded"]

#: Bound on shielded cleanup (closing streams) so that it cannot wedge a rank.
CLOSE_TIMEOUT = 5.0


class ChannelState(enum.Enum):
    """Guards ``__aenter__`` against reuse."""

    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


class _Closable(Protocol):
    async def aclose(self) -> None: ...


async def aclose_shielded(*resources: _Closable | None) -> None:
    """Close ``resources`` in order (``None`` is skipped), shielded from cancellation and
    within :data:`CLOSE_TIMEOUT` seconds for all of them."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT):
        for resource in resources:
            if resource is not None:
                await resource.aclose()


@contextlib.asynccontextmanager
async def _own_tasks() -> AsyncIterator[TaskGroup]:
    """A task group whose tasks are cancelled when the channel's ``async with`` block ends.

    An error of the block leaves the block as it is, never wrapped in an exception group: the
    tasks are cancelled and awaited on their own (errors of theirs chain to it). A
    cancellation, which may be the group's own scope's, goes to the group, which knows
    whether it is its own.
    """
    block_error: BaseException | None = None
    async with anyio.create_task_group() as group:
        try:
            yield group
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException as error:
            block_error = error
        finally:
            group.cancel_scope.cancel()
    if block_error is not None:
        raise block_error


@attrs.define(eq=False)
class ChannelLifecycle:
    """The base of the control channels: an async context manager that can be entered once,
    owns a task group (entered through an :class:`~contextlib.AsyncExitStack`, with the
    channel's cleanup) and closes through :meth:`aclose`.

    ``__aexit__`` returns what the task group's does: true only when the block's
    cancellation was the group's own. It raises an ``ExceptionGroup`` only for a bug in one of
    the channel's tasks.
    """

    _RUNS_TASKS: ClassVar[bool] = True
    """Whether the channel has tasks of its own (the in-process root has none)."""

    _state: ChannelState = attrs.field(default=ChannelState.NEW, init=False)
    _exits: contextlib.AsyncExitStack = attrs.field(factory=contextlib.AsyncExitStack, init=False)
    _task_group: TaskGroup | None = attrs.field(default=None, init=False)
    """The channel's own tasks (set while it is open, when it runs tasks)."""

    # -- what each channel says -------------------------------------------------------------

    def _identity(self) -> tuple[str, int]:
        """How the channel's errors name it (``"the root channel"``), and their rank."""
        raise NotImplementedError

    async def _prepare(self) -> None:
        """What must succeed before the channel's tasks start."""

    def _start_tasks(self, task_group: TaskGroup) -> None:
        """Start the channel's tasks in ``task_group``."""

    def _closing(self) -> None:
        """The channel's cleanup before its tasks are cancelled."""

    async def _closed(self) -> None:
        """The channel's cleanup after its tasks have ended, whatever happened."""

    # -- the lifecycle ----------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        what, rank = self._identity()
        if self._state is not ChannelState.NEW:
            raise ControlError(
                f"{what} can be entered only once; create a new channel", rank=rank, phase="open"
            )
        self._state = ChannelState.OPEN
        try:
            await self._prepare()
        except BaseException:
            self._state = ChannelState.CLOSED
            raise
        self._exits.push_async_callback(self._closed)
        if self._RUNS_TASKS:
            self._task_group = await self._exits.enter_async_context(_own_tasks())
            self._start_tasks(self._task_group)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        """Close as :meth:`aclose` does, with the block's exception: the task group must see
        a cancellation to tell its own from another's, and its tasks' errors chain to the
        block's error."""
        return await self._close(exc_type, exc, tb)

    async def aclose(self) -> None:
        """Close the channel before its ``async with`` block ends, as leaving the block does:
        its own cleanup, its tasks cancelled and awaited, then the cleanup that follows them.

        Call it from the task that entered the channel, where nothing entered after the
        channel is still open (the channel's task group closes in nesting order, as ``async
        with`` would close it). A closed channel stays closed: a second call, and the end of
        the block, do nothing. Raises an ``ExceptionGroup`` only for a bug in one of the
        channel's tasks.
        """
        await self._close(None, None, None)

    async def _close(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        if self._state is ChannelState.CLOSED:
            return None
        self._state = ChannelState.CLOSED
        self._closing()
        return await self._exits.__aexit__(exc_type, exc, tb)

    def _check_open(self, phase: Phase) -> None:
        """Refuse calls outside ``async with``."""
        if self._state is not ChannelState.OPEN:
            what, rank = self._identity()
            raise ControlError(
                f"{what} is {self._state.value}: use it inside 'async with'",
                rank=rank,
                phase=phase,
            )
