"""The root's driver: rendezvous, the epoch loop, the optimizer, and the end of the run."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio
import attrs
import torch

from .._checkpoint import by_index, local_shards, read_whole
from .._device import resolve_device
from .._effects import EpochOutcome, OptimizerFactory
from .._epoch import CheckpointParts, PassResult, PassRunner, flat_order
from .._errors import (
    CheckpointError,
    CliqueError,
    CliqueTimeout,
    ConfigError,
    LampdistError,
    RankFailed,
)
from .._loop import epochs
from .._model import original_module
from .._options import LoopOptions, ModelWithData, StepOptions, Timeouts, check_monitors
from .._preload import preload
from .._state import LoopState, TrainingState
from ..checkpoint import Resumed, Saver, check_before_training, open_saver, shards_writer
from ..clique import Clique, CliqueFactory
from ..control import Command, CommandKind, RootChannel
from ..schedules import LearningRateSchedule
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
from ._generations import Generations, check_recovery
from ._rank import RankContext, RunOptions, check_optimizer_factory, check_rank, open_rank
from ._resume import (
    check_schedule_state,
    fitting_model_state,
    load_model_state,
    load_optimizer_state,
    restore_rng,
    resumed_schedule_state,
)
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
    run = RunOptions(optimizer_factory, step, timeouts, stop, cliques)
    return await drive(nranks, resolve_device(device), control, data, run, loop, resume)


async def drive(
    nranks: int,
    torch_device: torch.device,
    control: RootChannel,
    data: ModelWithData,
    run: RunOptions,
    loop: LoopOptions,
    resume: Resumed | None,
) -> LoopState:
    """The root's run as :func:`drive_distributed_training` describes it, for this package's
    entry points: the device resolved, the options built once."""
    check_optimizer_factory(0, run)
    _check_fsdp_loop(run.step, loop)
    check_recovery(nranks, run, loop, control)
    lr_state = resumed_schedule_state(loop.learning_rate_schedule, resume)
    check_monitors(loop, data)
    if resume is not None and loop.max_epochs <= resume.epoch:
        logger.warning(
            "rank 0: the run resumes at epoch %d and max_epochs=%d: no epoch is left to train; "
            "raise max_epochs to train on",
            resume.epoch,
            loop.max_epochs,
            extra={"rank": 0},
        )
    with naming_rank(0):  # what the checkpoint's storage raises names no rank
        await check_before_training(loop.checkpoint_state, resume)
        async with open_rank(0, nranks, torch_device, data, run) as context:
            root = _Root(
                context=context, control=control, loop=loop, resume=resume, lr_state=lr_state
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


def _check_fsdp_loop(step: StepOptions, loop: LoopOptions) -> None:
    """Raise :class:`ConfigError` for what ``step_on="fsdp"`` does not do: checkpoints by
    another effect than :func:`lampdist.checkpoint.to_directory` or ``to_url`` (every rank
    writes its shards where they go) and the best model (it would need every rank's
    shards)."""
    if step.step_on != "fsdp":
        return
    effect = loop.checkpoint_state
    for unsupported, name, instead in (
        (
            effect is not None and shards_writer(effect) is None,
            "checkpoint_state other than checkpoint.to_directory(...) or to_url(...)",
            "checkpoint_state=checkpoint.to_directory(path)",
        ),
        (
            bool(loop.return_min_validation_loss_model),
            "return_min_validation_loss_model",
            "return_min_validation_loss_model=()",
        ),
    ):
        if unsupported:
            raise ConfigError(
                f"step_on='fsdp' does not support {name} (every rank holds shards of the "
                f"model): pass {instead}",
                rank=0,
                phase="configure",
            )


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


@attrs.frozen
class _UntilStopped:
    """``schedule``, but a factor of 0 (the epoch driver's "stop") once a stop is requested."""

    schedule: LearningRateSchedule[Any]
    stopping: Stopping

    @property
    def init(self) -> Any:
        return self.schedule.init

    @property
    def monitor(self) -> Any:
        return getattr(self.schedule, "monitor", None)

    def learning_rate_factor(
        self, state: Any, epoch: int, last_validation_loss: float | None
    ) -> tuple[Any, float]:
        if self.stopping.requested():
            logger.info(
                "stopping on request before epoch %d", epoch, extra={"rank": 0, "epoch": epoch}
            )
            return state, 0.0
        return self.schedule.learning_rate_factor(state, epoch, last_validation_loss)


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
    generations: Generations = attrs.field(init=False)
    setup_watch: anyio.CancelScope = attrs.field(factory=anyio.CancelScope)
    last_checkpoint: float = 0.0
    best_model_state: dict[str, torch.Tensor] | None = None
    pass_index: int = 0
    epoch: int = -1
    unsaved: tuple[LoopState, Any] | None = None  # the last epoch, if the interval skipped it
    saver: Saver | None = None  # while the epochs run with a checkpoint_state

    def __attrs_post_init__(self) -> None:
        self.generations = Generations(
            context=self.context,
            control=self.control,
            loop=self.loop,
            restore=self._restore,
            where=lambda: (self.epoch, self.pass_index),
        )

    @property
    def tracker(self) -> PhaseTracker:
        return self.context.tracker

    @property
    def data(self) -> ModelWithData:
        return self.context.data

    async def run(self) -> LoopState:
        """Restore, rendezvous, open the clique, agree, run the epochs, stop."""
        context, control = self.context, self.control
        loop_state = None
        if self.resume is not None:
            self.best_model_state = await context.compute.run(self._restore, self.resume)
            loop_state = self.resume.training_state.loop_state
        self.epoch = (loop_state.epoch if loop_state is not None else 0) - 1
        await self.generations.open(context.timeouts.join)
        try:
            try:
                runner = self._runner()
                await context.agree_and_sync(runner, resume=self.resume)
                if self.resume is not None and self.resume.rng_states is not None:
                    await context.compute.run(restore_rng, self.resume.rng_states)
                self.last_checkpoint = time.monotonic()
                if self.loop.recovery is not None:
                    await self.generations.take_snapshot()
                    self.setup_watch.cancel()  # from now on each effect watches (guarded)
                try:
                    final = await self._epochs_saving(loop_state)
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
        """STOP: every rank takes the final (or best) model."""
        if self.best_model_state is not None:
            module = original_module(self.data.model.module)
            await self.context.compute.run(module.load_state_dict, self.best_model_state)
        await self.control.broadcast(
            Command(kind=CommandKind.STOP, epoch=final.epoch, pass_index=self.pass_index)
        )
        await self._runner().sync_parameters()

    def _runner(self) -> PassRunner:
        """The pass runner of the clique's current generation."""
        return self.generations.current()

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

    async def _epochs_saving(self, loop_state: LoopState | None) -> LoopState:
        """The epochs, with the checkpoint effect's saver open around them (an asynchronous
        one writes in the background and is waited for, or aborted, on the way out)."""
        effect = self.loop.checkpoint_state
        if effect is None:
            return await self._epochs(loop_state)
        async with open_saver(effect) as self.saver:
            return await self._epochs(loop_state)

    async def _epochs(self, loop_state: LoopState | None) -> LoopState:
        loop = self.loop
        validates = self.data.validation_batches is not None
        final = await epochs(
            max_epochs=loop.max_epochs,
            train_epoch=self._train_epoch,
            validation_epoch=self._validation_epoch if validates else None,
            save_min_validation_loss_model=self._save_best,
            checkpoint_state=self._checkpoint if loop.checkpoint_state is not None else None,
            validation_frequency=loop.validation_frequency,
            return_min_validation_loss_model=loop.return_min_validation_loss_model,
            learning_rate_schedule=_UntilStopped(
                loop.learning_rate_schedule, self.context.stopping
            ),
            init_state=loop_state,
            learning_rate_schedule_init_state=self.lr_state,
            validation_loss_exponential_smoothing_factor=(
                loop.validation_loss_exponential_smoothing_factor
            ),
            best_model_monitor=loop.best_model_monitor,
            early_stopping=loop.early_stopping,
        )
        if self.unsaved is not None:  # a stop, early stopping or the schedule ended the loop
            await self._save(*self.unsaved)  # after an epoch the interval did not save
        return final

    def _restore(self, resume: Resumed) -> dict[str, torch.Tensor] | None:
        """Load the checkpointed model and optimizer (the compute thread); the best model.
        A design that loads checkpoints itself (fsdp) gets ``self.resume`` checked and
        loads it once sharded (see :meth:`Design.prepare`)."""
        state, module = resume.training_state, self.data.model.module
        design = self.context.design
        if design.loads_checkpoints:  # fsdp: every rank loads its shards once sharded
            if state.shards is None:
                fitted = fitting_model_state(module, state.model_state, path=resume.path)
                state = attrs.evolve(state, model_state=fitted)
                self.resume = attrs.evolve(resume, training_state=state)
            return None
        model_state, optimizer_state = state.model_state, state.optimizer_state
        if state.shards is not None:  # written by fsdp: read whole here
            with local_shards(state.shards.path, state.shards.options) as path:
                model_state, named = read_whole(path)
            optimizer_state = by_index(named, flat_order(original_module(module)))
        load_model_state(module, model_state, path=resume.path)
        stepper = design.stepper
        assert stepper is not None  # the root steps in every design but fsdp
        load_optimizer_state(stepper, optimizer_state, path=resume.path)
        if state.best_model_state is None:
            return None
        best = state.best_model_state
        best = fitting_model_state(module, best, path=resume.path, what="best-model")
        return _snapshot(best, self.context.device)

    async def _train_epoch(self, lr_factor: float) -> EpochOutcome:
        if self.saver is not None:
            self.saver.check()  # an asynchronous checkpoint that failed ends the run here
        self.epoch += 1
        epoch, pass_index = self.epoch, self.pass_index
        self.tracker.current, self.tracker.epoch, self.tracker.pass_index = (
            "train",
            epoch,
            pass_index,
        )

        async def attempt() -> PassResult:
            self.tracker.current = "train"
            await self.control.broadcast(
                Command(
                    kind=CommandKind.TRAIN, epoch=epoch, pass_index=pass_index, lr_factor=lr_factor
                )
            )
            return await self._runner().train_pass(
                self.data.train_batches, epoch=epoch, pass_index=pass_index, lr_factor=lr_factor
            )

        result = await self.generations.guarded(attempt, keep=True)
        self.pass_index += 1
        return (result.loss, result.metrics) if result.metrics else result.loss

    async def _validation_epoch(self) -> EpochOutcome:
        batches = self.data.validation_batches
        assert batches is not None
        epoch, pass_index = self.epoch, self.pass_index
        self.tracker.pass_index = pass_index

        async def attempt() -> PassResult:
            self.tracker.current = "valid"
            await self.control.broadcast(
                Command(kind=CommandKind.VALID, epoch=epoch, pass_index=pass_index)
            )
            return await self._runner().validation_pass(batches, epoch=epoch, pass_index=pass_index)

        result = await self.generations.guarded(attempt, keep=True)
        self.pass_index += 1
        return (result.loss, result.metrics) if result.metrics else result.loss

    async def _save_best(self) -> None:
        module = original_module(self.data.model.module)
        self.best_model_state = await self.context.compute.run(
            lambda: _snapshot(module.state_dict(), self.context.device)
        )

    async def _checkpoint(self, state: LoopState, lr_state: Any) -> None:
        if not self._checkpoint_due(state):
            self.unsaved = (state, lr_state)
            return
        await self._save(state, lr_state)

    async def _save(self, state: LoopState, lr_state: Any) -> None:
        checkpoint_state, saver = self.loop.checkpoint_state, self.saver
        assert checkpoint_state is not None and saver is not None
        self.unsaved = None
        check_schedule_state(self.loop.learning_rate_schedule, lr_state, epoch=state.epoch - 1)
        shards = None
        if self.context.design.loads_checkpoints:  # fsdp: every rank writes its shards
            await saver.finish()  # the write in flight owns the directory's scratch until done
            new_shards = shards_writer(checkpoint_state)
            assert new_shards is not None  # _check_fsdp_loop
            precision = self.context.options.step.fsdp.precision.to_plain()
            shards = await anyio.to_thread.run_sync(
                partial(new_shards, state.epoch, self.context.nranks, precision)
            )

        async def attempt() -> CheckpointParts | None:
            self.tracker.current = "checkpoint"
            await self.control.broadcast(
                Command(
                    kind=CommandKind.CHECKPOINT, epoch=state.epoch - 1, pass_index=self.pass_index
                )
            )
            return await self._runner().checkpoint_parts(shards)

        parts = await self.generations.guarded(attempt, keep=False)
        assert parts is not None  # on the root
        if shards is None:
            module = original_module(self.data.model.module)
            model_state = await self.context.compute.run(module.state_dict)
        else:
            model_state = {}
            shards = attrs.evolve(shards, records=parts.shard_records)
        training_state = TrainingState(
            loop_state=state,
            model_state=model_state,
            optimizer_state=parts.optimizer_state,
            best_model_state=self.best_model_state,
            rank_states=parts.rank_states,
            shards=shards,
        )
        self.last_checkpoint = time.monotonic()
        try:
            await saver.save(training_state, lr_state, stage_on=self.context.compute.run)
        except LampdistError:
            raise
        except Exception as exc:
            raise CheckpointError(
                f"epoch {state.epoch - 1}: checkpoint_state raised {type(exc).__name__}: {exc}",
                rank=0,
                phase="checkpoint",
            ) from exc

    def _checkpoint_due(self, state: LoopState) -> bool:
        """Whether this epoch's end is checkpointed: every epoch, or with
        ``loop.checkpoint_interval`` once that many seconds have passed since the last
        checkpoint, and always after the last epoch and when a stop was requested (an epoch
        skipped here is still saved if the loop then ends: see :meth:`_epochs`)."""
        interval = self.loop.checkpoint_interval
        if (
            interval is None
            or state.epoch >= self.loop.max_epochs
            or self.context.stopping.requested()
        ):
            return True
        return time.monotonic() - self.last_checkpoint >= interval


def _snapshot(state: Any, device: torch.device) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().to(device, copy=True) for name, tensor in state.items()}
