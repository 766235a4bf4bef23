"""The root's clique over its generations, and the in-job recovery of lost followers.

A *generation* is one rendezvous and the clique over it (:meth:`Generations.open` to
:meth:`Generations.close`). A run has one, unless the root recovers lost followers (see
:class:`lampdist.Recovery` and ``_recovery``): then every effect that all ranks carry out
(a pass, a checkpoint's parts) runs :meth:`Generations.guarded`, which watches the control
channel beside it, keeps a snapshot after it, and when a follower is lost ends the
generation (HOLD), waits for the replacement, opens the next one (REJOIN), puts every rank
back at the snapshot and runs the effect again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from functools import partial
from typing import TypeVar, cast

import anyio
import attrs

from .._effects import OnEvent
from .._epoch import DESIGNS, PassRunner
from .._errors import (
    CliqueError,
    CliqueTimeout,
    ConfigError,
    JoinTimeout,
    LampdistError,
    MismatchError,
)
from .._options import LoopOptions
from .._state import Recovered
from ..checkpoint import Resumed
from ..clique import Clique, ProcessGroups
from ..control import Command, CommandKind, RecoverableRootChannel, RootChannel
from ._failures import (
    PhaseTracker,
    describe,
    end_unresponsive,
    find_culprit,
    most_telling,
    single_error,
    watch_peers,
)
from ._fsdp_recovery import (
    GoneBack,
    check_fsdp_recovery,
    check_shards_kept,
    no_checkpoint_yet,
    recovers_from_checkpoint,
)
from ._rank import RankContext, RunOptions
from ._recovery import HOLD_MARGIN, is_consequence, is_lost
from ._run_state import RunState

__all__ = ["Generations", "check_recovery"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

REFUSED_LEAVE_TIMEOUT = 2.0
"""How long the root lets a replacement that failed the agreement check end by itself."""


def check_recovery(nranks: int, run: RunOptions, loop: LoopOptions, control: RootChannel) -> None:
    """Raise :class:`ConfigError` for recovery where a lost rank's state is nowhere else
    (a design that does not recover; fsdp without its replica, see ``_fsdp_recovery``) or
    its process cannot be replaced (followers in the root's process, over in-process
    cliques or channels)."""
    if loop.recovery is None or nranks == 1:
        return
    check_fsdp_recovery(run.step, loop)
    if not DESIGNS[run.step.step_on].recovers:
        raise ConfigError(
            f"LoopOptions.recovery does not support step_on={run.step.step_on!r} (each rank "
            "holds shards of the model that no other rank has): pass recovery=None, and "
            "resume from the checkpoint after a loss",
            rank=0,
            phase="configure",
        )
    in_process = not isinstance(control, RecoverableRootChannel)
    if in_process or (run.cliques is not None and not isinstance(run.cliques, ProcessGroups)):
        raise ConfigError(
            "LoopOptions.recovery needs one process per rank over process groups and a "
            f"channel that can replace a follower, not {type(run.cliques).__name__} cliques "
            f"over {type(control).__name__}: pass cliques=None or ProcessGroups(...) and "
            "control=lampdist.control.tcp_root(...)",
            rank=0,
            phase="configure",
        )


@attrs.define(eq=False)
class Generations:
    """The root's clique, generation after generation (see the module docstring)."""

    context: RankContext
    control: RootChannel
    loop: LoopOptions
    state: RunState
    """The run's state: what a snapshot takes and a recovery goes back to."""
    where: Callable[[], tuple[int, int]]
    """The root's epoch and pass index now (what HOLD, REJOIN and the snapshot carry)."""
    runner: PassRunner | None = None
    """The pass runner over the current generation's clique."""
    stack: AsyncExitStack | None = None
    """The current generation's rendezvous and clique, open."""
    recoveries: int = 0
    from_step: int = 0
    """The step of the pass in flight at which its last snapshot was kept (a pass run as
    segments, ``Recovery.snapshot_every_steps``), from which a loss redoes it; else 0."""
    rejoined: float = 0.0
    """When every follower had last joined (``time.monotonic()``)."""

    @property
    def tracker(self) -> PhaseTracker:
        return self.context.tracker

    @property
    def epoch(self) -> int:
        return max(self.where()[0], 0)

    @property
    def pass_index(self) -> int:
        return self.where()[1]

    def clique_to_end(self) -> Clique | None:
        """The current clique, through which the root ends an unresponsive follower's
        process (``None`` without a clique, or with ``Timeouts(end_unresponsive=False)``)."""
        if self.runner is None or not self.context.timeouts.end_unresponsive:
            return None
        return self.runner.clique

    def current(self) -> PassRunner:
        """The pass runner of the clique's current generation."""
        assert self.runner is not None  # between open() and close()
        return self.runner

    async def open(self, join_within: float | None, *, rejoin: bool = False) -> None:
        """A rendezvous, its clique id published, the followers joined within ``join_within``
        s (with ``rejoin``, the survivors of a loss told the new id by REJOIN), and this rank's
        clique over it: :attr:`runner`, until :meth:`close`."""
        context, control = self.context, self.control
        async with AsyncExitStack() as stack:
            clique_id = await stack.enter_async_context(context.cliques.rendezvous(context.nranks))
            await control.publish_clique_id(clique_id)
            await control.wait_for_peers(context.nranks - 1, join_within)
            self.rejoined = time.monotonic()
            if rejoin:
                await control.broadcast(
                    Command(
                        kind=CommandKind.REJOIN,
                        epoch=self.epoch,
                        pass_index=self.pass_index,
                        clique_id=clique_id,
                    )
                )
            opened = context.open_clique(clique_id, loop=self.loop)
            self.runner = await stack.enter_async_context(opened)
            self.stack = stack.pop_all()  # open until close()

    async def close(self, error: BaseException | None) -> None:
        """Close the current generation's clique and rendezvous (``error``: what ends it)."""
        stack, self.stack = self.stack, None
        if stack is None:
            return
        if self.runner is not None:
            self.runner.close()
        if error is None:
            await stack.aclose()
        else:
            await stack.__aexit__(type(error), error, error.__traceback__)

    # -- recovery ---------------------------------------------------------------------------

    async def watched(self, work: Callable[[], Awaitable[T]]) -> T:
        """``await work()`` while the control channel is watched: a follower's failure
        cancels it (which aborts the clique) and is raised."""
        if self.loop.recovery is None:
            return await work()  # the root's watch beside the whole run is on
        failure: list[LampdistError] = []
        results: list[T] = []

        async def watch(scope: anyio.CancelScope) -> None:
            try:
                await watch_peers(self.control.watch, self.tracker)
            except LampdistError as exc:
                await end_unresponsive(exc, self.clique_to_end())
                failure.append(exc)
                scope.cancel()

        with single_error():
            async with anyio.create_task_group() as group:
                group.start_soon(watch, group.cancel_scope)
                results.append(await work())
                group.cancel_scope.cancel()
        if failure:
            raise failure[0]
        return results[0]

    async def guarded(self, work: Callable[[], Awaitable[T]], *, keep: bool) -> T:
        """``await work()``, an effect that every rank carries out; under recovery a lost
        follower is recovered and ``work`` redone from the last snapshot, which with
        ``keep`` is then taken anew (the effect changed the ranks' state)."""
        if self.loop.recovery is None:
            return await work()
        while True:
            try:
                result = await self.watched(work)
                if keep:
                    await self.watched(self.take_snapshot)
            except Exception as exc:
                lost = await self.lost(exc)
                if not lost:
                    raise
                await self.recover(lost, exc)
            else:
                return result

    @property
    def from_checkpoint(self) -> bool:
        """Whether a recovery goes back to the newest checkpoint (fsdp without its
        replica): then no snapshot is kept."""
        return recovers_from_checkpoint(self.context.options.step, self.loop)

    async def take_snapshot(self) -> None:
        """Every rank hands the root its part of the state, which the root keeps in memory
        with a copy of its model and optimizer state: what a recovery goes back to."""
        if self.from_checkpoint:
            return
        await self.state.keep_snapshot(self.current(), epoch=self.epoch, pass_index=self.pass_index)

    async def lost(self, error: BaseException) -> dict[int, LampdistError]:
        """The followers lost (by rank, with their errors) when ``error`` is the consequence
        of losing them, else nothing: the run ends for ``error`` as without recovery."""
        leaf = most_telling(error)
        if not is_consequence(leaf):
            return {}
        control = self.recoverable()
        failures = await control.lost_followers()
        if not failures and isinstance(leaf, CliqueError | CliqueTimeout):
            await find_culprit(control.watch, self.tracker)
            failures = await control.lost_followers()
        if isinstance(leaf, LampdistError) and is_lost(leaf) and leaf.rank is not None:
            failures.setdefault(leaf.rank, leaf)
        if not failures or not all(is_lost(failure) for failure in failures.values()):
            return {}
        return failures

    async def recover(self, lost: dict[int, LampdistError], error: BaseException) -> None:
        """Take the lost followers' replacements in and put every rank back at the last
        snapshot, within ``recovery.rejoin_timeout`` of the loss. Raises when recoveries
        are used up, a rank is not back in time, or the recovery itself fails; with
        :attr:`from_checkpoint`, every rank goes back to the newest checkpoint instead and
        :class:`GoneBack` is raised (a :class:`CheckpointError` before the first one)."""
        recovery = self.loop.recovery
        assert recovery is not None
        phase, epoch, pass_index = self.tracker.current, self.epoch, self.pass_index
        started = time.monotonic()
        self._count_recovery(lost, error)
        ranks = set(lost)
        reason = "; ".join(f"rank {rank}: {describe(e)}" for rank, e in sorted(lost.items()))
        logger.warning(
            "lost rank(s) %s in phase %r of epoch %d: %s; recovery %d of %d: waiting up to "
            "%s s for them to rejoin",
            sorted(ranks),
            phase,
            epoch,
            reason,
            self.recoveries,
            recovery.max_recoveries,
            recovery.rejoin_timeout,
            extra={"rank": 0, "epoch": epoch},
        )
        back = None
        if self.from_checkpoint:
            back = await self.state.newest_checkpoint()
            if back is None:
                raise no_checkpoint_yet(ranks, self.state.checkpoints, phase, epoch) from error
            pass_index = self.state.saved_passes.get(back.epoch - 1, 0)  # the first run again
        deadline = started + recovery.rejoin_timeout
        ranks = await self._rejoin(ranks, reason, deadline, error, back)
        seconds = time.monotonic() - started
        waited = self.rejoined - started
        logger.warning(
            "recovered rank(s) %s in %.2f s (%.2f s of it until they rejoined): %s",
            sorted(ranks),
            seconds,
            waited,
            (
                f"pass {pass_index} (epoch {epoch}) is redone from "
                + (f"step {self.from_step}" if self.from_step else "its start")
            )
            if back is None
            else f"the run goes back to the checkpoint of epoch {back.epoch - 1}",
            extra={"rank": 0, "epoch": epoch},
        )
        if self.loop.on_event is not None:
            on_event = cast(OnEvent, self.loop.on_event)  # it takes a Recovered too
            await on_event(
                Recovered(
                    ranks=tuple(sorted(ranks)),
                    phase=phase,
                    epoch=epoch,
                    pass_index=pass_index,
                    seconds=seconds,
                    rejoin_seconds=waited,
                    recoveries=self.recoveries,
                    reason=reason,
                    checkpoint_epoch=None if back is None else back.epoch - 1,
                    from_step=self.from_step,
                )
            )
        if back is not None:
            raise GoneBack(back, pass_index)

    def _count_recovery(self, lost: dict[int, LampdistError], error: BaseException) -> None:
        """Count this recovery; raise the first lost rank's error (chained to ``error``) when
        the run has had as many as ``Recovery.max_recoveries`` allows."""
        recovery = self.loop.recovery
        assert recovery is not None
        self.recoveries += 1
        if self.recoveries > recovery.max_recoveries:
            first = lost[min(lost)]
            raise type(first)(
                f"{first.message} (the run has had {recovery.max_recoveries} recoveries, as "
                "many as Recovery.max_recoveries allows)",
                rank=first.rank,
                phase=first.phase,
            ) from error

    async def _rejoin(
        self,
        ranks: set[int],
        reason: str,
        deadline: float,
        error: BaseException,
        back: Resumed | None,
    ) -> set[int]:
        """Hold, then regroup with the replacements of ``ranks`` by ``deadline``
        (``time.monotonic()``), refusing a replacement that does not match and taking in
        the followers lost meanwhile; every rank lost, once regrouped (at the snapshot, or
        at the checkpoint ``back``)."""
        recovery = self.loop.recovery
        assert recovery is not None
        phase, epoch = self.tracker.current, self.epoch
        while True:
            self.tracker.current = "recover"
            ranks |= await self.hold(ranks, reason)
            if back is None:
                check_shards_kept(self.context.options.step, ranks, self.context.nranks)
            try:
                await self.regroup(deadline - time.monotonic(), back)
            except MismatchError as refused:
                logger.warning(
                    "refused the process that joined as rank(s) %s: %s; waiting for another",
                    sorted(ranks),
                    refused,
                    extra={"rank": 0},
                )
                # It raises the same MismatchError: let it end on that before its channel
                # is closed, which it would otherwise report as the root going away.
                await self.control.wait_until_left(ranks, REFUSED_LEAVE_TIMEOUT)
            except JoinTimeout as late:
                raise JoinTimeout(
                    f"rank(s) {sorted(ranks)}, lost in phase {phase!r} of epoch {epoch} "
                    f"({reason}), did not rejoin within {recovery.rejoin_timeout} s: "
                    f"{late.message}",
                    rank=min(ranks),
                    phase="recover",
                ) from error
            except Exception as again:
                more = await self.lost(again)
                if not more:
                    raise
                ranks |= set(more)
            else:
                return ranks

    async def hold(self, ranks: set[int], reason: str) -> set[int]:
        """End the clique's generation without ``ranks``: abort the clique (which frees the
        root's collectives), forget the ranks (new processes may join as them), tell the
        survivors to HOLD, close the clique. Returns the followers lost meanwhile."""
        control = self.recoverable()
        if self.runner is not None:
            self.runner.clique.abandon(f"rank(s) {sorted(ranks)} were lost")
        await control.forget(ranks)
        more: set[int] = set()
        try:
            await control.broadcast(
                Command(
                    kind=CommandKind.HOLD,
                    epoch=self.epoch,
                    pass_index=self.pass_index,
                    error=f"the root recovers from losing rank(s) {sorted(ranks)}: {reason}",
                    timeout=self.hold_timeout(),
                )
            )
        except LampdistError:
            failures = await control.lost_followers()
            if not failures or not all(is_lost(failure) for failure in failures.values()):
                raise
            more = set(failures)
            await control.forget(more)
        await self.close(None)
        return more

    def recoverable(self) -> RecoverableRootChannel:
        """The control channel, which :func:`_check_recovery` found able to replace
        followers."""
        assert isinstance(self.control, RecoverableRootChannel)
        return self.control

    def hold_timeout(self) -> float | None:
        """How long a survivor holds for the root's REJOIN: the root's own deadlines, plus a
        margin (``None`` when the clique setup has none)."""
        recovery, setup = self.loop.recovery, self.context.timeouts.setup
        assert recovery is not None
        if setup is None:
            return None
        return recovery.rejoin_timeout + setup + HOLD_MARGIN

    async def regroup(self, join_within: float, back: Resumed | None = None) -> None:
        """The clique's next generation with the lost ranks' replacements (joined within
        ``join_within`` s), every rank put back at the last snapshot (or the checkpoint
        ``back``, each rank loading its shards of it)."""
        await self.open(max(join_within, 0.0), rejoin=True)
        resume = await (self.state.load_snapshot() if back is None else self.state.load(back))
        await self.watched(partial(self.state.settle, self.current(), resume))
