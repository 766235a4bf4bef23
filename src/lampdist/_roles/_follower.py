"""The follower: join, open the clique, run the pass the root commands, until STOP."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from functools import partial

import anyio
import attrs
import torch
from anyio.streams.memory import MemoryObjectReceiveStream

from .._device import resolve_device
from .._effects import OptimizerFactory
from .._epoch import PassRunner
from .._errors import (
    CliqueError,
    CliqueTimeout,
    ConfigError,
    LampdistError,
    LampdistTimeout,
    MismatchError,
    PeerDisconnected,
    Phase,
    RankFailed,
    name_rank,
)
from .._options import ModelWithData, StepOptions, Timeouts
from .._preload import preload
from .._state import LoopState
from ..clique import CliqueFactory, CliqueId
from ..control import Command, CommandKind, FollowerChannel
from ._commands import carry_out
from ._failures import (
    CULPRIT_TIMEOUT,
    DERIVED,
    PhaseTracker,
    describe,
    find_culprit,
    most_telling,
    naming_rank,
    watch_peers,
)
from ._rank import RankContext, RunOptions, check_optimizer_factory, check_rank, open_rank
from ._stopping import abandoned_stop

__all__ = ["follow", "follow_distributed_training"]

logger = logging.getLogger(__name__)

REPORT_TIMEOUT = 1.0

ROOT_REASON_TIMEOUT = 2 * CULPRIT_TIMEOUT + 1.0
"""How long a follower whose collective failed waits for the root's reason; the root itself
first waits up to CULPRIT_TIMEOUT for the control channel to name a culprit."""

ROOT_EXIT_TIMEOUT = 5.0
"""How long a follower that the root stopped with an error of its own waits for the root's
process to end (see :meth:`FollowerChannel.wait_until_root_left`) before it exits."""


async def follow_distributed_training(
    *,
    rank: int,
    nranks: int,
    device: torch.device | str | int,
    control: FollowerChannel,
    data: ModelWithData,
    optimizer_factory: OptimizerFactory | None = None,
    step: StepOptions = StepOptions(),
    timeouts: Timeouts = Timeouts(),
    stop: anyio.Event | None = None,
    cliques: CliqueFactory | None = None,
) -> LoopState:
    """Follow a data-parallel training run as rank ``rank`` (1..nranks-1) until the root stops it.

    The follower joins through ``control`` (within ``timeouts.join``), opens the clique on
    ``device`` with the clique id the root published, and for each command runs one training
    or validation pass over ``data``'s batches on its compute thread. Stepping on the root
    (lamp's design), it holds no optimizer: each step sends its example-weighted gradients
    to the root and receives the root's parameters; with ``step.step_on="every_rank"`` it
    steps its own, built by ``optimizer_factory``, and with ``"sharded"`` its slice of it.
    On STOP it receives the final (or best) weights into ``data.model.module`` and returns
    the root's final :class:`~lampdist.LoopState` (the one the root returns; its learning
    curve cut to the newest epochs that one control frame carries, see
    the ``max_frame_bytes`` of :func:`lampdist.control.tcp_root`).

    ``step`` must equal the root's (checked when the ranks agree), and ``cliques`` must be
    the root's kind (process groups by default; the in-process cliques shared with a root in
    this process). ``stop`` asks for a graceful end: the follower goes on following until the
    root's STOP, for at most ``timeouts.stop`` seconds, and then abandons the run with
    :class:`~lampdist.LampdistTimeout` (phase ``'stop'``); before training began (join,
    clique setup, agreement) it abandons the run so at once.

    Raises :class:`~lampdist.ConfigError` for bad arguments or settings; those of its
    optimizer factory, its design or its clique also go to the root, which raises them in
    turn (found before joining, they are reported by a join for that alone, within
    ``timeouts.join``). Raises :class:`~lampdist.MismatchError` when this rank disagrees
    with the root,
    :class:`~lampdist.RankFailed` when the root (rank 0) aborts the run, naming its error,
    :class:`~lampdist.PeerDisconnected` when the root vanishes, and the errors of this
    rank's own training (:class:`~lampdist.TrainingError`), which it also reports to the root.
    Several unrelated failures at once come as an ``ExceptionGroup``.
    """
    check_rank(rank, nranks)
    if rank == 0:
        raise ConfigError("rank 0 is the root: call drive_distributed_training for it")
    await preload()
    run = RunOptions(optimizer_factory, step, timeouts, cliques)
    return await follow(rank, nranks, resolve_device(device), control, data, run, stop)


async def follow(
    rank: int,
    nranks: int,
    torch_device: torch.device,
    control: FollowerChannel,
    data: ModelWithData,
    run: RunOptions,
    stop: anyio.Event | None = None,
) -> LoopState:
    """Rank ``rank``'s run as :func:`follow_distributed_training` describes it, for this
    package's entry points: the device resolved, the options built once."""
    try:
        return await _follow(rank, nranks, torch_device, control, data, run, stop)
    except RankFailed as exc:
        if exc.rank == 0 and exc.phase == "stop":  # the root's own error: it exits first
            await control.wait_until_root_left(ROOT_EXIT_TIMEOUT)
        raise


async def _follow(
    rank: int,
    nranks: int,
    torch_device: torch.device,
    control: FollowerChannel,
    data: ModelWithData,
    run: RunOptions,
    stop: anyio.Event | None,
) -> LoopState:
    with naming_rank(rank):  # what the checkpoint's storage raises names no rank
        async with AsyncExitStack() as stack:
            try:
                check_optimizer_factory(rank, run)
                context = await stack.enter_async_context(
                    open_rank(rank, nranks, torch_device, data, run, stop)
                )
            except ConfigError as exc:  # before joining: the root would wait for this rank
                name_rank(exc, rank)
                await _report_unjoined(control, run, exc, stop)
                raise
            follower = _Follower(context=context, control=control)
            send, receive = anyio.create_memory_object_stream[Command](math.inf)
            with receive:
                watch = partial(watch_peers, control.watch, context.tracker)
                async with context.supervised(watch, partial(follower.tell_root, receive)):
                    await follower.run(receive, send)
    return follower.final


async def _report_unjoined(
    control: FollowerChannel, run: RunOptions, error: ConfigError, stop: anyio.Event | None
) -> None:
    """Best effort: join the root only to report ``error``, bad settings found before this
    rank joined (its optimizer factory, its options), in its phase (``'configure'``), so that
    the root raises it at once (as a :class:`ConfigError` naming this rank) and tells the
    other followers, rather than wait ``Timeouts.join`` for this rank. Within
    ``Timeouts.join``; a stop requested meanwhile (a signal) ends the attempt, and a root
    that refuses the join or is gone is left alone."""
    send, receive = anyio.create_memory_object_stream[Command](math.inf)
    with send, receive, anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            if stop is not None:
                group.start_soon(_cancel_on, stop, scope)
            try:
                await control.join(send, timeout=run.timeouts.join)
            except LampdistError as exc:
                logger.debug("could not join the root to report %s: %s", error, exc)
            else:
                await _report(control, error.phase or "configure", error)
            group.cancel_scope.cancel()


async def _cancel_on(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def _report(control: FollowerChannel, phase: Phase, error: BaseException) -> None:
    """Best effort: tell the root why this rank stops."""
    with anyio.move_on_after(REPORT_TIMEOUT):
        try:
            await control.report_failure(phase, describe(error))
        except LampdistError as exc:
            logger.debug("could not report the failure to the root: %s", exc)


async def _find_culprit(
    commands: MemoryObjectReceiveStream[Command], control: FollowerChannel, tracker: PhaseTracker
) -> LampdistError | None:
    """After a collective failed: the root's own reason for stopping (its STOP with an error,
    which follows the failure by a moment), or the channel's word that the root vanished,
    whichever comes first within :data:`ROOT_REASON_TIMEOUT` seconds."""
    found: LampdistError | None = None

    async def from_root(scope: anyio.CancelScope) -> None:
        nonlocal found
        async for command in commands:
            if command.kind is CommandKind.STOP and command.error is not None:
                found = RankFailed(command.error, rank=0, phase="stop")
                scope.cancel()
                return

    async def from_channel(scope: anyio.CancelScope) -> None:
        nonlocal found
        error = await find_culprit(control.watch, tracker)
        if found is None:
            found = error
        if error is not None:
            scope.cancel()

    with anyio.move_on_after(ROOT_REASON_TIMEOUT):
        async with anyio.create_task_group() as group:
            group.start_soon(from_root, group.cancel_scope)
            group.start_soon(from_channel, group.cancel_scope)
    return found


class _Held(Exception):
    """The root's HOLD (``command``) ended the clique's generation: a rank was lost."""

    def __init__(self, command: Command | None) -> None:
        super().__init__(command)
        self.command = command


@attrs.define(eq=False)
class _Follower:
    """One run of a follower, from joining to STOP: one generation of the clique, or more
    when the root recovers a lost rank (see :class:`lampdist.Recovery`)."""

    context: RankContext
    control: FollowerChannel
    clique_id: CliqueId | None = None
    """The current generation's clique id."""
    pending: Command | None = None
    """A command read while a pass ran (see :meth:`_interruptible`), to carry out next."""
    hold_timeout: float | None = ROOT_REASON_TIMEOUT
    """How long to wait for the root's next word while held (the last HOLD's timeout)."""
    final: LoopState = attrs.field(factory=LoopState)
    """The root's final loop state, from its STOP (an empty one until then)."""

    @property
    def tracker(self) -> PhaseTracker:
        return self.context.tracker

    async def run(
        self,
        commands: MemoryObjectReceiveStream[Command],
        send: anyio.abc.ObjectSendStream[Command],
    ) -> None:
        clique_id: CliqueId | None = await self.control.join(
            send, timeout=self.context.timeouts.join
        )
        recovering = False
        while clique_id is not None:
            held = await self._generation(clique_id, commands, recovering=recovering)
            if not held:
                return
            clique_id = await self._rejoin(commands)
            recovering = True

    async def _generation(
        self,
        clique_id: CliqueId,
        commands: MemoryObjectReceiveStream[Command],
        *,
        recovering: bool,
    ) -> bool:
        """One generation of the clique: ``False`` once the run stopped, ``True`` when the
        root's HOLD ended it (the clique is closed on return)."""
        self.clique_id = clique_id
        async with self.context.open_clique(clique_id) as runner:
            try:
                await self._follow_commands(runner, commands)
            except _Held as held:
                if held.command is not None:
                    self._hold(held.command)
                runner.clique.abandon(f"rank {self.context.rank} holds: a rank was lost")
                return True
            except Exception as exc:
                leaf = most_telling(exc)
                if recovering and isinstance(leaf, MismatchError) and leaf.phase == "agreement":
                    # The root refuses the replacement that joined and waits for another.
                    logger.warning(
                        "rank %d: the process that joined as rank(s) %s was refused: %s",
                        self.context.rank,
                        leaf.rank,
                        leaf,
                        extra={"rank": self.context.rank},
                    )
                    return True
                # Report before the clique closes, so the root learns the cause before the
                # collectives on other ranks fail.
                if _root_must_hear(leaf):
                    with anyio.CancelScope(shield=True):
                        await _report(self.control, self.tracker.current, exc)
                self.tracker.reported = True
                raise
        return False

    def _hold(self, command: Command) -> None:
        self.tracker.current = "recover"
        self.hold_timeout = command.timeout
        logger.warning(
            "rank %d holds: %s", self.context.rank, command.error, extra={"rank": self.context.rank}
        )

    async def _rejoin(self, commands: MemoryObjectReceiveStream[Command]) -> CliqueId:
        """While held: the next generation's clique id, from the root's REJOIN. Raises
        :class:`RankFailed` for the root's STOP with an error, :class:`PeerDisconnected` when
        the root vanishes, :class:`LampdistTimeout` when no REJOIN comes in time."""
        self.tracker.current = "recover"
        while True:
            waited = self.hold_timeout
            with anyio.move_on_after(waited):
                command = await self._next(commands)
                if command.kind is CommandKind.REJOIN and command.clique_id != self.clique_id:
                    assert command.clique_id is not None  # a REJOIN has one
                    return command.clique_id
                if command.kind is CommandKind.STOP:
                    raise RankFailed(
                        command.error or "the root stopped the run while this rank held",
                        rank=0,
                        phase="stop",
                    )
                if command.kind is CommandKind.HOLD:
                    self._hold(command)
                continue
            raise LampdistTimeout(
                f"rank {self.context.rank} held for {waited} s without the root's REJOIN",
                rank=0,
                phase="recover",
            )

    async def _next(self, commands: MemoryObjectReceiveStream[Command]) -> Command:
        """The next command: one read ahead, or the next from the root. Raises
        :class:`PeerDisconnected` when the channel ends without STOP."""
        if self.pending is not None:
            command, self.pending = self.pending, None
            return command
        try:
            return await commands.receive()
        except anyio.EndOfStream:
            raise PeerDisconnected(
                "the root closed the control channel without STOP",
                rank=0,
                phase=self.tracker.current,
            ) from None

    async def _interruptible(
        self, commands: MemoryObjectReceiveStream[Command], work: Callable[[], Awaitable[None]]
    ) -> None:
        """``await work()`` while the next command is read ahead: the root's HOLD (a rank was
        lost) cancels the work (which aborts the clique) and raises :class:`_Held`; another
        command waits in :attr:`pending`. When the work fails in a collective, the root's
        HOLD is waited for (for a moment) and raised instead."""
        held: list[Command] = []

        async def read_ahead(scope: anyio.CancelScope) -> None:
            if self.pending is not None:
                return
            try:
                command = await commands.receive()
            except anyio.EndOfStream:
                return  # the watch says why
            if command.kind is CommandKind.HOLD:
                held.append(command)
                scope.cancel()
            else:
                self.pending = command

        failure: Exception | None = None
        async with anyio.create_task_group() as group:
            group.start_soon(read_ahead, group.cancel_scope)
            try:
                await work()
            except Exception as exc:
                failure = exc
            group.cancel_scope.cancel()
        if held:
            raise _Held(held[0])
        if failure is None:
            return
        if isinstance(most_telling(failure), CliqueError | CliqueTimeout):
            command = await self._root_word(commands)
            if command is not None:
                raise _Held(command) from failure
        raise failure

    async def _root_word(self, commands: MemoryObjectReceiveStream[Command]) -> Command | None:
        """After a failed collective: the root's HOLD if it comes within
        :data:`ROOT_REASON_TIMEOUT` (commands before it are moot: the root redoes them);
        ``None`` otherwise, leaving a STOP for :meth:`tell_root` to find."""
        with anyio.move_on_after(ROOT_REASON_TIMEOUT):
            while True:
                try:
                    command = await self._next(commands)
                except PeerDisconnected:
                    return None
                if command.kind is CommandKind.HOLD:
                    return command
                if command.kind is CommandKind.STOP:
                    self.pending = command
                    return None
        return None

    async def tell_root(
        self, commands: MemoryObjectReceiveStream[Command], error: BaseException
    ) -> None:
        """Whatever ended the run (``error``): after a failed collective, the root's reason
        or the channel's word that the root vanished (raised instead, chained); else this
        rank's own error goes to the root, unless it already has it or it is the consequence
        of a failure elsewhere."""
        if not isinstance(error, Exception):
            return
        leaf = most_telling(error)
        if isinstance(leaf, CliqueError | CliqueTimeout):
            pending, self.pending = self.pending, None  # read ahead: the root's STOP, if any
            if pending is not None and pending.kind is CommandKind.STOP and pending.error:
                raise RankFailed(pending.error, rank=0, phase="stop") from leaf
            culprit = await _find_culprit(commands, self.control, self.tracker)
            if culprit is not None:
                raise culprit from leaf
        if not self.tracker.reported and _root_must_hear(leaf):
            # Only an original error: a failed or timed-out collective here is the
            # consequence of a failure elsewhere, and the root must not blame us. A stop
            # this rank abandoned (a signal) is reported in phase 'stop': the root's
            # recovery takes such a rank as lost, since a new process would not repeat it.
            phase: Phase = "stop" if abandoned_stop(leaf) else self.tracker.current
            with anyio.CancelScope(shield=True):
                await _report(self.control, phase, error)

    async def _follow_commands(
        self, runner: PassRunner, commands: MemoryObjectReceiveStream[Command]
    ) -> None:
        await self._interruptible(commands, partial(self.context.agree_and_sync, runner))
        self.tracker.current = "wait for command"
        try:
            await self._run_commands(runner, commands)
        finally:
            runner.close()

    async def _run_commands(
        self, runner: PassRunner, commands: MemoryObjectReceiveStream[Command]
    ) -> None:
        tracker = self.tracker
        while True:
            try:
                command = await self._next(commands)
            except PeerDisconnected as exc:
                raise type(exc)(exc.message, rank=exc.rank, phase=tracker.current) from None
            if command.kind is CommandKind.STOP:
                if command.error is not None:
                    raise RankFailed(command.error, rank=0, phase="stop")
                self.context.stopping.reached.set()
                await carry_out(runner, self.context.data, command, tracker)
                if command.state is not None:
                    self.final = command.state
                return
            if command.kind is CommandKind.HOLD:
                raise _Held(command)
            if command.kind is CommandKind.REJOIN:
                continue  # this generation's (a replacement joins with the new id)
            tracker.epoch = command.epoch
            work = partial(carry_out, runner, self.context.data, command, tracker)
            await self._interruptible(commands, work)
            tracker.current = "wait for command"


def _root_must_hear(error: BaseException) -> bool:
    """Whether the root learns of ``error`` only from this rank: not for the consequence of a
    failure elsewhere, nor for a disagreement, which the agreement check raises on every rank
    (the root's own MismatchError is the clearer error there)."""
    agreed = isinstance(error, MismatchError) and error.phase == "agreement"
    return not agreed and not isinstance(error, DERIVED)
