"""The root's driver: rendezvous, the epoch loop, the optimizer, and the end of the run."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio
import attrs
import torch

from .._checkpoint import Storage, storage_for
from .._device import resolve_device
from .._effects import EpochOutcome, OptimizerFactory
from .._epoch import PassResult, PassRunner, segments
from .._errors import CliqueError, CliqueTimeout, LampdistError, RankFailed
from .._loop import EpochEffects, merge_sets, run_epochs
from .._options import LoopOptions, ModelWithData, StepOptions, Timeouts, check_monitors
from .._preload import preload
from .._state import LoopState
from ..checkpoint import Resumed
from ..clique import Clique, CliqueFactory
from ..control import Command, CommandKind, RootChannel
from ._commands import order
from ._failures import (
    PhaseTracker,
    describe,
    end_unresponsive,
    find_culprit,
    most_telling,
    naming_rank,
    reported_config_error,
    watch_peers,
)
from ._fsdp_recovery import GoneBack
from ._generations import Generations, check_recovery
from ._rank import RankContext, RunOptions, check_optimizer_factory, check_rank, open_rank
from ._resume import check_data_places, resumed_schedule_state
from ._root_checks import check_design_loop, check_segments
from ._run_state import RunState
from ._stopping import Stopping

__all__ = ["drive", "drive_distributed_training"]

logger = logging.getLogger(__name__)


ABORT_TIMEOUT = 2.0
"""How long the root tries to tell the followers why it stops."""

LEAVE_TIMEOUT = 2.0
"""How long the root waits for a follower that failed on its own to close its channel."""

EXIT_HEAD_START = 0.3
"""How much longer the root then waits: the failed process's last lines and exit (torchrun
polls its processes every 0.1 s)."""


async def drive_distributed_training(
    *,
    nranks: int,
    device: torch.device | str | int,
    control: RootChannel,
    data: ModelWithData,
    optimizer_factory: OptimizerFactory,
    loop: LoopOptions,
    step: StepOptions = StepOptions(),
    timeouts: Timeouts = Timeouts(),
    resume: Resumed | None = None,
    stop: anyio.Event | None = None,
    cliques: CliqueFactory | None = None,
) -> LoopState:
    """Drive a data-parallel training run as the root (rank 0) and return the final loop state.

    The root publishes a clique id on ``control``, waits up to ``timeouts.join`` for the
    ``nranks - 1`` followers, opens the clique on ``device``, checks that every rank has the
    same model layout and :class:`~lampdist.StepOptions`, and runs the epoch loop of ``loop``
    (see :func:`lampdist.epochs` for the schedule, validation, smoothing and best-model
    rules) over ``data``. It holds the optimizer that ``optimizer_factory`` builds over the
    model's parameters. Each pass runs as a plain loop on this rank's compute thread; the
    event loop starts passes and awaits their ends. ``loop.checkpoint_state`` is awaited
    after every epoch with the live state dicts (copy them if you keep them past the call);
    ``loop.on_event`` receives the progress of the passes (:class:`~lampdist.PassEvent`),
    and the steps never wait for it. At the end every rank holds the best model (if
    ``loop.return_min_validation_loss_model`` made one) or the final one.

    ``resume`` (what :func:`lampdist.checkpoint.load_latest` returned) continues a run: the
    model, optimizer, best model and loop state, and the schedule state rebuilt against
    ``loop.learning_rate_schedule`` (a :class:`~lampdist.CheckpointError` with phase
    ``'resume'`` when it does not fit).

    ``stop`` ends the run early and gracefully (set it from a signal handler, say): once it
    is set, the root starts no new epoch; the epoch in progress finishes, validates and is
    checkpointed as usual, then the followers get STOP and the root returns the loop state,
    whose ``epoch`` is the next epoch to run. When that epoch has not ended within
    ``timeouts.stop`` seconds of the request, or at once when the request comes before
    training began (join, clique setup, agreement: nothing to finish), the root abandons the
    run: it raises :class:`~lampdist.LampdistTimeout` with ``phase='stop'``, the followers
    raise :class:`~lampdist.RankFailed` naming it, and the last committed checkpoint is the
    one to resume from.

    ``cliques`` says where the clique comes from: process groups through a rendezvous store
    served on 127.0.0.1 (``lampdist.clique.ProcessGroups(host)`` names another address the
    followers dial), or an in-process clique shared with followers that are tasks of this
    process (:func:`lampdist.clique.in_process`); a root alone (``nranks=1``) uses an
    in-process one.

    Raises :class:`~lampdist.ConfigError` for bad arguments, a follower's too (the error it
    reported, of its own type, naming its rank and phase), :class:`~lampdist.MismatchError`
    when ranks disagree, :class:`~lampdist.RankFailed` or :class:`~lampdist.PeerDisconnected`
    naming a follower that failed otherwise, :class:`~lampdist.JoinTimeout`, and the errors
    of the training itself (:class:`~lampdist.TrainingError`, :class:`~lampdist.NonFiniteLoss`,
    :class:`~lampdist.CheckpointError`). Several unrelated failures at once come as an
    ``ExceptionGroup``.
    """
    check_rank(0, nranks)
    await preload()
    run = RunOptions(optimizer_factory, step, timeouts, cliques)
    return await drive(nranks, resolve_device(device), control, data, run, loop, resume, stop)


async def drive(
    nranks: int,
    torch_device: torch.device,
    control: RootChannel,
    data: ModelWithData,
    run: RunOptions,
    loop: LoopOptions,
    resume: Resumed | None,
    stop: anyio.Event | None = None,
    *,
    evaluating: bool = False,
) -> LoopState:
    """The root's run as :func:`drive_distributed_training` describes it, for this package's
    entry points: the device resolved, the options built once. ``evaluating``: instead of the
    epochs, every validation set once with its result shared (:func:`lampdist.evaluate`);
    the loop state returned is the resumed one."""
    check_optimizer_factory(0, run)
    effect = loop.checkpoint_state
    storage = storage_for(effect) if effect is not None else None
    check_design_loop(run.step, loop, storage)
    check_segments(run.step, loop)
    check_recovery(nranks, run, loop, control)
    lr_state = resumed_schedule_state(loop.learning_rate_schedule, resume)
    check_data_places(resume, nranks)
    check_monitors(loop, data)
    if resume is not None and loop.max_epochs <= resume.epoch and not evaluating:
        logger.warning(
            "rank 0: the run resumes at epoch %d and max_epochs=%d: no epoch is left to train; "
            "raise max_epochs to train on",
            resume.epoch,
            loop.max_epochs,
            extra={"rank": 0},
        )
    with naming_rank(0):  # what the checkpoint's storage raises names no rank
        if storage is not None:
            next_epoch = resume.epoch if resume is not None else 0
            await storage.check_before_training(next_epoch, resumed=resume is not None)
        async with open_rank(0, nranks, torch_device, data, run, stop) as context:
            root = _Root(
                context=context,
                control=control,
                loop=loop,
                resume=resume,
                lr_state=lr_state,
                storage=storage,
                evaluating=evaluating,
            )
            stopping = context.stopping
            try:
                async with context.supervised(root.watch, root.tell_followers):
                    state = await root.run()
            except Exception as exc:
                if stopping.ended_it(exc):
                    raise stopping.timeout_error() from exc
                bad_settings = reported_config_error(exc)  # a follower's, as a ConfigError
                if bad_settings is not None:
                    raise bad_settings from exc
                raise
    return state


async def _let_exit_first(
    control: RootChannel, tracker: PhaseTracker, failure: BaseException | None
) -> None:
    """When ``failure`` is a follower's report of its own error, give that follower a head
    start, once, before the root tells the other followers or ends itself: wait until its
    channel closes (its process is ending), then :data:`EXIT_HEAD_START`, so that it exits
    before every other rank and a launcher that reports the first process to fail (torchrun's
    "Root Cause") names it. The other followers wait for the root's reason meanwhile."""
    if tracker.head_start_given or not isinstance(failure, RankFailed) or not failure.rank:
        return
    tracker.head_start_given = True
    await control.wait_until_left([failure.rank], LEAVE_TIMEOUT)
    await anyio.sleep(EXIT_HEAD_START)


async def _watch(
    control: RootChannel, tracker: PhaseTracker, clique: Callable[[], Clique | None]
) -> None:
    """Raise when a follower fails, remembering why (it cancels the run); an unresponsive
    one's process is ended first when ``clique()`` can (see :func:`end_unresponsive`)."""
    try:
        await watch_peers(control.watch, tracker)
    except LampdistError as exc:
        tracker.cause = exc
        await end_unresponsive(exc, clique())
        raise


def _why(error: BaseException, tracker: PhaseTracker, stopping: Stopping) -> BaseException:
    """What to tell the followers: a cancellation is the stop timeout or a follower's
    failure (the watch cancels the run) when it is one of those."""
    if isinstance(error, anyio.get_cancelled_exc_class()):
        if stopping.abandoned is not None:
            return stopping.timeout_error()
        if tracker.cause is not None:
            return tracker.cause
    return error


async def _abort_followers(
    control: RootChannel, tracker: PhaseTracker, error: BaseException
) -> None:
    """Best effort: tell the followers that still listen why the run stops."""
    message = f"the root stopped in phase {tracker.current!r}: {describe(error)}"
    with anyio.move_on_after(ABORT_TIMEOUT):
        try:
            await control.broadcast(
                Command(
                    kind=CommandKind.STOP,
                    epoch=tracker.epoch,
                    pass_index=tracker.pass_index,
                    error=message,
                )
            )
        except LampdistError as exc:
            logger.debug("could not tell every follower that the run stops: %s", exc)


@attrs.define(eq=False)
class _Root:
    """One run of the root, from the rendezvous to STOP: the effects the epoch loop awaits."""

    context: RankContext
    control: RootChannel
    loop: LoopOptions
    resume: Resumed | None
    lr_state: Any
    storage: Storage | None = None
    """Where the checkpoints go (``storage_for`` the ``checkpoint_state``)."""
    evaluating: bool = False
    """An evaluation-only run: every set validated once, no epoch, the model kept as loaded."""
    state: RunState = attrs.field(init=False)
    generations: Generations = attrs.field(init=False)
    setup_watch: anyio.CancelScope = attrs.field(factory=anyio.CancelScope)
    pass_index: int = 0
    epoch: int = -1

    def __attrs_post_init__(self) -> None:
        where = partial(_where, self)
        self.state = RunState.create(
            self.context,
            self.control,
            self.loop,
            self.storage,
            runner=self._runner,
            guarded=lambda work: self.generations.guarded(work, keep=False),
            where=where,
        )
        self.generations = Generations(
            context=self.context,
            control=self.control,
            loop=self.loop,
            state=self.state,
            where=where,
        )

    @property
    def tracker(self) -> PhaseTracker:
        return self.context.tracker

    @property
    def data(self) -> ModelWithData:
        return self.context.data

    async def run(self) -> LoopState:
        """Restore, rendezvous, open the clique, agree, run the epochs, stop."""
        context, control, resume = self.context, self.control, self.resume
        loop_state = None
        if resume is not None:
            resume = await self.state.load(resume)
            loop_state = resume.training_state.loop_state
        self.epoch = (loop_state.epoch if loop_state is not None else 0) - 1
        await self.generations.open(context.timeouts.join)
        try:
            try:
                await self.state.settle(self._runner(), resume)
                self.state.rule.restart()
                if self.loop.recovery is not None:
                    await self.generations.take_snapshot()
                    self.setup_watch.cancel()  # from now on each effect watches (guarded)
                try:
                    run = self._evaluate if self.evaluating else self._epochs
                    final = await run(loop_state)
                finally:
                    self._runner().close()
                self.tracker.current = "stop"
                context.stopping.reached.set()
                await self.generations.watched(partial(self._stop, final))
            except BaseException as exc:
                # Tell the followers before the clique closes, so that they learn the
                # reason rather than see the clique break.
                if not isinstance(most_telling(exc), CliqueError | CliqueTimeout):
                    with anyio.CancelScope(shield=True):
                        await _let_exit_first(control, self.tracker, self.tracker.cause)
                        reason = _why(exc, self.tracker, context.stopping)
                        await _abort_followers(control, self.tracker, reason)
                    self.tracker.reported = True
                raise
        except BaseException as exc:
            await self.generations.close(exc)
            raise
        await self.generations.close(None)
        return final

    async def watch(self) -> None:
        """Beside the run: a follower that fails ends it (see :func:`_watch`); under recovery
        only until training begins, after which each effect watches for itself."""
        with self.setup_watch:
            await _watch(self.control, self.tracker, self.generations.clique_to_end)
        await anyio.sleep_forever()

    async def _stop(self, final: LoopState) -> None:
        """STOP: every rank takes the final (or best) model (an evaluation's: the loaded),
        and the followers the final loop state, which they return."""
        if not self.evaluating:
            await self.state.take_best()
        await self._order(
            Command(
                kind=CommandKind.STOP, epoch=final.epoch, pass_index=self.pass_index, state=final
            )
        )

    def _runner(self) -> PassRunner:
        """The pass runner of the clique's current generation."""
        return self.generations.current()

    async def _order(self, command: Command) -> Any:
        """Send ``command`` and carry it out with the followers (see ``_commands``)."""
        return await order(self.control, self._runner(), self.data, command, self.tracker)

    async def tell_followers(self, error: BaseException) -> None:
        """Whatever ended the run (``error``): tell the followers that still listen why, unless
        they know, after letting a follower that failed on its own exit first; a failed
        collective is blamed on the follower that the control channel names, if one does
        (raised instead of ``error``, chained)."""
        control, tracker = self.control, self.tracker
        if not isinstance(error, Exception):  # a cancellation: the watch's, the stop's, ours
            with anyio.CancelScope(shield=True):
                await _let_exit_first(control, tracker, tracker.cause)
                if not tracker.reported:
                    reason = _why(error, tracker, self.context.stopping)
                    await _abort_followers(control, tracker, reason)
            return
        leaf = most_telling(error)
        culprit = None
        if isinstance(leaf, CliqueError | CliqueTimeout):
            culprit = await find_culprit(control.watch, tracker)
        with anyio.CancelScope(shield=True):
            await _let_exit_first(control, tracker, culprit or leaf)
            if not tracker.reported:
                await _abort_followers(control, tracker, culprit or error)
        if culprit is not None:
            raise culprit from leaf

    async def _epochs(self, loop_state: LoopState | None) -> LoopState:
        """The epochs (see :func:`lampdist.epochs`), with the checkpoints' storage open around
        them, until the last or a stop; the last epoch saved if the save rule skipped it.
        A recovery that went back to a checkpoint (:class:`GoneBack`) starts them again from
        its loop state and schedule state, as a run resumed from it."""
        state = self.state
        validates = self.data.validation_batches is not None
        effects = EpochEffects(
            train_epoch=self._train_epoch,
            validation_epoch=self._validation_epoch if validates else None,
            save_min_validation_loss_model=state.save_best,
            checkpoint_state=state.epoch_ended if state.checkpoints is not None else None,
        )
        lr_state, stop = self.lr_state, self.context.stopping.requested
        async with state.opened():
            while True:
                try:
                    final = await run_epochs(
                        self.loop, effects, init_state=loop_state, lr_state=lr_state, stop=stop
                    )
                    await state.finish()
                except GoneBack as back:
                    loop_state = back.resume.training_state.loop_state
                    schedule = self.loop.learning_rate_schedule
                    lr_state = resumed_schedule_state(schedule, back.resume)
                    self.epoch, state.unsaved = loop_state.epoch - 1, None
                    self.pass_index = back.pass_index
                else:
                    return final

    async def _evaluate(self, loop_state: LoopState | None) -> LoopState:
        """Every validation set once, each result shared with every rank."""
        for name in self.data.validation_sets or (None,):
            await self.validate(name, share_result=True)
        return loop_state if loop_state is not None else LoopState()

    async def _train_epoch(self, lr_factor: float) -> EpochOutcome:
        self.state.check_saves()  # an asynchronous checkpoint that failed ends the run here
        self.epoch += 1
        epoch, pass_index = self.epoch, self.pass_index
        self.tracker.current, self.tracker.epoch, self.tracker.pass_index = (
            "train",
            epoch,
            pass_index,
        )
        command = Command(
            kind=CommandKind.TRAIN, epoch=epoch, pass_index=pass_index, lr_factor=lr_factor
        )
        result = None
        for segment in self._segments():  # each a guarded effect, its snapshot kept
            self.generations.from_step = 0 if segment is None else segment[0]
            ordered = partial(self._order, attrs.evolve(command, segment=segment))
            result = await self.generations.guarded(ordered, keep=True)
        self.generations.from_step = 0
        self.pass_index += 1
        assert result is not None  # the last segment's
        return (result.loss, result.metrics) if result.metrics else result.loss

    def _segments(self) -> list[tuple[int, int, int] | None]:
        """How a training pass runs: whole (``[None]``), or under
        ``Recovery(snapshot_every_steps=K)`` as the window's segments of K steps (see
        ``_epoch._segments``)."""
        recovery, window = self.loop.recovery, self.context.options.step.steps_per_epoch
        if recovery is None or recovery.snapshot_every_steps is None or window is None:
            return [None]
        return list(segments(window, recovery.snapshot_every_steps))

    async def _validation_epoch(self) -> EpochOutcome:
        """Validate every set in order (one VALID each); the driving set's loss and the
        sets' metrics (see :func:`merge_sets`)."""
        sets = self.data.validation_sets or (None,)
        outcomes = []
        for name in sets:
            result = await self.validate(name)
            outcomes.append((name, result.loss, result.metrics))
        return merge_sets(outcomes, self.loop.validation_set)

    async def validate(self, name: str | None, *, share_result: bool = False) -> PassResult:
        """One VALID pass over the set ``name`` on every rank; the validation before
        training belongs to the first epoch (the epoch of its events)."""
        epoch, pass_index = max(self.epoch, 0), self.pass_index
        self.tracker.epoch, self.tracker.pass_index = epoch, pass_index
        command = Command(
            kind=CommandKind.VALID,
            epoch=epoch,
            pass_index=pass_index,
            validation_set=name,
            share_result=share_result,
        )
        result: PassResult = await self.generations.guarded(
            partial(self._order, command), keep=True
        )
        self.pass_index += 1
        return result


def _where(root: _Root) -> tuple[int, int]:
    """The root's epoch and pass index now."""
    return root.epoch, root.pass_index
