"""The root's driver: rendezvous, the epoch loop, the optimizer, and the end of the run."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from functools import partial
from typing import Any, Literal

import anyio
import attrs
import torch

from .._effects import BatchSource, CheckpointState
from .._epoch import (
    ComputeThread,
    FlatModel,
    OnPassEvent,
    RankRunner,
    StepKernel,
    StepOn,
    Stepper,
    SupervisedModel,
    TrainingOptions,
    open_compute_thread,
)
from .._errors import (
    CheckpointError,
    CliqueError,
    CliqueTimeout,
    ConfigError,
    LampdistError,
    LampdistTimeout,
)
from .._loop import check_epochs_arguments, epochs
from .._state import LoopState, TrainingState
from ..clique import Cliques, ProcessGroups, in_process
from ..control import Command, CommandKind, RootChannel
from ..schedules import LearningRateSchedule, noop
from ._common import (
    OptimizerFactory,
    Phase,
    agree,
    check_rank,
    create_stepper,
    describe,
    find_culprit,
    most_telling,
    resolve_device,
    single_error,
    watch_peers,
)

__all__ = ["drive_distributed_training"]

logger = logging.getLogger(__name__)

ABORT_TIMEOUT = 2.0
"""How long the root tries to tell the followers why it stops."""


async def drive_distributed_training(
    *,
    nranks: int,
    device: torch.device | str | int,
    control: RootChannel,
    model: SupervisedModel,
    optimizer_factory: OptimizerFactory,
    train_batches: BatchSource,
    validation_batches: BatchSource | None = None,
    max_epochs: int,
    checkpoint_state: CheckpointState | None = None,
    validation_frequency: int = 1,
    return_min_validation_loss_model: Iterable[int] = (),
    learning_rate_schedule: LearningRateSchedule[Any] | None = None,
    init_state: TrainingState | None = None,
    accumulate_gradient_over_n_batches: int = 1,
    learning_rate_schedule_init_state: Any = None,
    validation_loss_exponential_smoothing_factor: float = 1.0,
    max_grad_norm: float | None = None,
    autocast_dtype: torch.dtype | None = None,
    non_finite_loss: Literal["raise", "skip"] = "raise",
    step_on: StepOn = "root",
    bucket_cap_mb: float | None = None,
    on_event: OnPassEvent | None = None,
    rendezvous_host: str = "127.0.0.1",
    cliques: Cliques | None = None,
    join_timeout: float | None = 300.0,
    setup_timeout: float | None = 300.0,
    collective_timeout: float | None = 600.0,
    stop: anyio.Event | None = None,
    stop_timeout: float | None = 30.0,
) -> LoopState:
    """Drive a data-parallel training run as the root (rank 0) and return the final loop state.

    The root publishes a fresh clique id on ``control``, waits up to ``join_timeout`` for the
    ``nranks - 1`` followers, opens the clique on ``device``, checks that every rank has the
    same model layout and settings, and runs the epoch loop (see :func:`lampdist.epochs` for
    the schedule, validation, smoothing and best-model rules). It holds the optimizer: each
    step reduces the example-weighted gradients of all ranks to the root, steps, and
    broadcasts the parameters back, all at once after backward; with ``bucket_cap_mb`` the
    gradients travel instead in buckets of about that many megabytes, each sent as soon as
    backward has produced it (measured slower than the default on 2 H200 GPUs so far; see
    the performance page). ``checkpoint_state`` is awaited after every epoch with the
    live state dicts (copy them if you keep them past the call). At the end every rank holds
    the best model (if ``return_min_validation_loss_model`` made one) or the final one.

    ``init_state`` and ``learning_rate_schedule_init_state`` resume a run; pass what
    ``lampdist.checkpoint.load_latest`` returned. ``on_event`` receives the root's
    :class:`~lampdist.PassEvent` progress: a training pass's first step, then the newest at
    most every 50 ms, and the end of every pass; the steps never wait for it.

    Each pass runs as a plain loop on this rank's compute thread, which also builds the
    model's layout and the optimizer; the event loop starts passes and awaits their ends.
    ``cliques`` says where the clique comes from: process groups through a rendezvous store
    served at ``rendezvous_host`` (:class:`lampdist.clique.ProcessGroups`, the default), or an
    in-process clique shared with followers that are tasks of this process
    (:func:`lampdist.clique.in_process`); a root alone (``nranks=1``) uses an in-process one.

    ``stop`` ends the run early and gracefully (set it from a signal handler, say): once it
    is set, the root starts no new epoch; the epoch in progress finishes, validates and is
    checkpointed as usual, then the followers get STOP and the root returns the loop state,
    whose ``epoch`` is the next epoch to run (resume from the checkpoint to continue). When
    that epoch (or the join and clique setup before the first one) has not ended within
    ``stop_timeout`` seconds of the request (``None``: no limit), the root abandons it: it
    raises :class:`~lampdist.LampdistTimeout` with ``phase='stop'``, the followers raise
    :class:`~lampdist.RankFailed` naming it, and the last committed checkpoint is the one
    to resume from. Keep ``stop_timeout`` below the grace period of your scheduler.

    Raises :class:`~lampdist.ConfigError` for bad arguments, :class:`~lampdist.MismatchError`
    when ranks disagree, :class:`~lampdist.RankFailed` or :class:`~lampdist.PeerDisconnected`
    naming a follower that failed, :class:`~lampdist.JoinTimeout`, and the errors of the
    training itself (:class:`~lampdist.TrainingError`, :class:`~lampdist.NonFiniteLoss`).
    Several unrelated failures at once come as an ``ExceptionGroup``.
    """
    check_rank(0, nranks)
    if stop_timeout is not None and not stop_timeout >= 0:
        raise ConfigError(
            f"stop_timeout must be >= 0 seconds or None, got {stop_timeout!r}",
            rank=0,
            phase="configure",
        )
    torch_device = resolve_device(device)
    options = TrainingOptions(
        accumulate_gradient_over_n_batches=accumulate_gradient_over_n_batches,
        max_grad_norm=max_grad_norm,
        autocast_dtype=autocast_dtype,
        non_finite_loss=non_finite_loss,
        step_on=step_on,
        bucket_cap_mb=bucket_cap_mb,
    )
    schedule = learning_rate_schedule if learning_rate_schedule is not None else noop()
    check_epochs_arguments(
        max_epochs,
        validation_frequency,
        validation_loss_exponential_smoothing_factor,
        init_state.loop_state if init_state is not None else LoopState(),
    )
    if cliques is None:
        # A root alone has nothing to exchange: an in-process clique of one rank, with no
        # process group, store or thread behind it.
        alone = nranks == 1
        cliques = (
            in_process([torch_device], collective_timeout=collective_timeout)
            if alone
            else ProcessGroups(rendezvous_host)
        )
    async with open_compute_thread(0, torch_device) as compute:
        # On the compute thread, with every other torch operation of this rank: moving the
        # model and building the optimizer can take seconds, and the control channel must
        # keep answering meanwhile. A root alone exchanges nothing: no gradient buffers.
        layout = partial(FlatModel.create, model.module, torch_device, gradients=nranks > 1)
        flat = await compute.run(layout)
        stepper = await compute.run(create_stepper, 0, optimizer_factory, flat, options)
        phase = Phase("join")
        stopping = _Stopping(stop, stop_timeout)
        with single_error():
            async with anyio.create_task_group() as group:
                group.start_soon(_watch, control, phase)
                if stop is not None:
                    group.start_soon(stopping.enforce, phase)
                try:
                    with stopping.scope:
                        state = await _run(
                            nranks=nranks,
                            device=torch_device,
                            control=control,
                            model=model,
                            compute=compute,
                            flat=flat,
                            stepper=stepper,
                            options=options,
                            schedule=schedule,
                            train_batches=train_batches,
                            validation_batches=validation_batches,
                            max_epochs=max_epochs,
                            checkpoint_state=checkpoint_state,
                            validation_frequency=validation_frequency,
                            return_min_validation_loss_model=return_min_validation_loss_model,
                            init_state=init_state,
                            learning_rate_schedule_init_state=learning_rate_schedule_init_state,
                            smoothing=validation_loss_exponential_smoothing_factor,
                            on_event=on_event,
                            cliques=cliques,
                            join_timeout=join_timeout,
                            setup_timeout=setup_timeout,
                            collective_timeout=collective_timeout,
                            phase=phase,
                            stopping=stopping,
                        )
                    stopping.check_abandoned()
                except Exception as exc:
                    leaf = most_telling(exc)
                    culprit = None
                    if isinstance(leaf, CliqueError | CliqueTimeout):
                        culprit = await find_culprit(control.watch, phase)
                    if not phase.reported:
                        with anyio.CancelScope(shield=True):
                            await _abort_followers(control, phase, culprit or exc)
                    if culprit is not None:
                        raise culprit from leaf
                    raise
                except BaseException as exc:
                    if not phase.reported:
                        with anyio.CancelScope(shield=True):
                            await _abort_followers(control, phase, _why(exc, phase, stopping))
                    raise
                group.cancel_scope.cancel()
    return state


async def _watch(control: RootChannel, phase: Phase) -> None:
    """Raise when a follower fails, remembering why (it cancels the run)."""
    try:
        await watch_peers(control.watch, phase)
    except LampdistError as exc:
        phase.cause = exc
        raise


def _why(error: BaseException, phase: Phase, stopping: _Stopping) -> BaseException:
    """What to tell the followers: a cancellation is the stop timeout or a follower's
    failure (the watch cancels the run) when it is one of those."""
    if isinstance(error, anyio.get_cancelled_exc_class()):
        if stopping.abandoned is not None:
            return stopping.timeout_error()
        if phase.cause is not None:
            return phase.cause
    return error


@attrs.define(eq=False)
class _Stopping:
    """A graceful stop: no new epoch once ``stop`` is set, and a deadline for the current one."""

    stop: anyio.Event | None
    timeout: float | None
    scope: anyio.CancelScope = attrs.field(factory=anyio.CancelScope)
    reached: anyio.Event = attrs.field(factory=anyio.Event)
    abandoned: str | None = None

    def requested(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    async def enforce(self, phase: Phase) -> None:
        """Once stop is set, give the run ``timeout`` seconds to reach the end of an epoch."""
        assert self.stop is not None
        await self.stop.wait()
        logger.info(
            "stop requested in phase %r of epoch %d: no new epoch starts; the current one "
            "has %s s to finish",
            phase.name,
            phase.epoch,
            self.timeout,
            extra={"rank": 0, "epoch": phase.epoch},
        )
        with anyio.move_on_after(self.timeout):
            await self.reached.wait()
            return
        self.abandoned = f"{phase.name!r} of epoch {phase.epoch}"
        logger.warning(
            "stop_timeout=%s s passed in phase %s: abandoning it",
            self.timeout,
            self.abandoned,
            extra={"rank": 0, "epoch": phase.epoch},
        )
        self.scope.cancel()

    def timeout_error(self) -> LampdistTimeout:
        return LampdistTimeout(
            f"stop was requested, but phase {self.abandoned} did not end within "
            f"stop_timeout={self.timeout} s: abandoned it; resume from the last checkpoint",
            rank=0,
            phase="stop",
        )

    def check_abandoned(self) -> None:
        """Raise the stop timeout if :meth:`enforce` abandoned the run."""
        if self.abandoned is not None:
            raise self.timeout_error()


@attrs.frozen
class _UntilStopped:
    """``schedule``, but a factor of 0 (the epoch driver's "stop") once a stop is requested."""

    schedule: LearningRateSchedule[Any]
    stopping: _Stopping

    @property
    def init(self) -> Any:
        return self.schedule.init

    def learning_rate_factor(
        self, state: Any, epoch: int, last_validation_loss: float | None
    ) -> tuple[Any, float]:
        if self.stopping.requested():
            logger.info(
                "stopping on request before epoch %d", epoch, extra={"rank": 0, "epoch": epoch}
            )
            return state, 0.0
        return self.schedule.learning_rate_factor(state, epoch, last_validation_loss)


async def _abort_followers(control: RootChannel, phase: Phase, error: BaseException) -> None:
    """Best effort: tell the followers that still listen why the run stops."""
    message = f"the root stopped in phase {phase.name!r}: {describe(error)}"
    with anyio.move_on_after(ABORT_TIMEOUT):
        try:
            await control.broadcast(
                Command(
                    kind=CommandKind.STOP,
                    epoch=phase.epoch,
                    pass_index=phase.pass_index,
                    error=message,
                )
            )
        except LampdistError as exc:
            logger.debug("could not tell every follower that the run stops: %s", exc)


async def _run(
    *,
    nranks: int,
    device: torch.device,
    control: RootChannel,
    model: SupervisedModel,
    compute: ComputeThread,
    flat: FlatModel,
    stepper: Stepper,
    options: TrainingOptions,
    schedule: LearningRateSchedule[Any],
    train_batches: BatchSource,
    validation_batches: BatchSource | None,
    max_epochs: int,
    checkpoint_state: CheckpointState | None,
    validation_frequency: int,
    return_min_validation_loss_model: Iterable[int],
    init_state: TrainingState | None,
    learning_rate_schedule_init_state: Any,
    smoothing: float,
    on_event: OnPassEvent | None,
    cliques: Cliques,
    join_timeout: float | None,
    setup_timeout: float | None,
    collective_timeout: float | None,
    phase: Phase,
    stopping: _Stopping,
) -> LoopState:
    module = model.module
    optimizer = stepper.optimizer
    best_model_state: dict[str, torch.Tensor] | None = None
    loop_state = None
    if init_state is not None:
        resume = init_state

        def restore() -> dict[str, torch.Tensor] | None:
            module.load_state_dict(resume.model_state)
            optimizer.load_state_dict(dict(resume.optimizer_state))
            if resume.best_model_state is None:
                return None
            return _snapshot(resume.best_model_state, device)

        best_model_state = await compute.run(restore)
        loop_state = init_state.loop_state
    first_epoch = loop_state.epoch if loop_state is not None else 0

    async with cliques.rendezvous(nranks) as clique_id:
        await control.publish_clique_id(clique_id)
        await control.wait_for_peers(nranks - 1, join_timeout)
        phase.name = "clique setup"
        async with cliques.open(
            rank=0,
            nranks=nranks,
            device=device,
            clique_id=clique_id,
            setup_timeout=setup_timeout,
            collective_timeout=collective_timeout,
        ) as clique:
            kernel = StepKernel(
                rank=0, clique=clique, model=model, flat=flat, options=options, stepper=stepper
            )
            runner = RankRunner(kernel=kernel, compute=compute, on_event=on_event)
            try:
                phase.name = "agreement"
                validates = validation_batches is not None
                await runner.run(partial(agree, clique, flat, options, validates=validates))
                await runner.sync_parameters()
                if options.step_on == "every_rank":
                    await runner.sync_optimizer_state()
                pass_index = 0
                epoch = first_epoch - 1

                async def train_epoch(lr_factor: float) -> float:
                    nonlocal pass_index, epoch
                    epoch += 1
                    phase.name, phase.epoch, phase.pass_index = "train", epoch, pass_index
                    await control.broadcast(
                        Command(
                            kind=CommandKind.TRAIN,
                            epoch=epoch,
                            pass_index=pass_index,
                            lr_factor=lr_factor,
                        )
                    )
                    result = await runner.train_pass(
                        train_batches, epoch=epoch, pass_index=pass_index, lr_factor=lr_factor
                    )
                    pass_index += 1
                    return result.loss

                async def validation_epoch() -> float:
                    nonlocal pass_index
                    assert validation_batches is not None
                    phase.name, phase.pass_index = "valid", pass_index
                    await control.broadcast(
                        Command(kind=CommandKind.VALID, epoch=epoch, pass_index=pass_index)
                    )
                    result = await runner.validation_pass(
                        validation_batches, epoch=epoch, pass_index=pass_index
                    )
                    pass_index += 1
                    return result.loss

                async def save_best() -> None:
                    nonlocal best_model_state
                    best_model_state = await compute.run(
                        lambda: _snapshot(module.state_dict(), device)
                    )

                async def checkpoint(state: LoopState, lr_state: Any) -> None:
                    assert checkpoint_state is not None
                    phase.name = "checkpoint"
                    model_state, optimizer_state = await compute.run(
                        lambda: (module.state_dict(), optimizer.state_dict())
                    )
                    training_state = TrainingState(
                        loop_state=state,
                        model_state=model_state,
                        optimizer_state=optimizer_state,
                        best_model_state=best_model_state,
                    )
                    try:
                        await checkpoint_state(training_state, lr_state)
                    except LampdistError:
                        raise
                    except Exception as exc:
                        raise CheckpointError(
                            f"epoch {state.epoch - 1}: checkpoint_state raised "
                            f"{type(exc).__name__}: {exc}",
                            rank=0,
                            phase="checkpoint",
                        ) from exc

                final = await epochs(
                    max_epochs=max_epochs,
                    train_epoch=train_epoch,
                    validation_epoch=validation_epoch if validation_batches is not None else None,
                    save_min_validation_loss_model=save_best,
                    checkpoint_state=checkpoint if checkpoint_state is not None else None,
                    validation_frequency=validation_frequency,
                    return_min_validation_loss_model=return_min_validation_loss_model,
                    learning_rate_schedule=_UntilStopped(schedule, stopping),
                    init_state=loop_state,
                    learning_rate_schedule_init_state=learning_rate_schedule_init_state,
                    validation_loss_exponential_smoothing_factor=smoothing,
                )
                phase.name = "stop"
                stopping.reached.set()
                if best_model_state is not None:
                    await compute.run(module.load_state_dict, best_model_state)
                await control.broadcast(
                    Command(kind=CommandKind.STOP, epoch=final.epoch, pass_index=pass_index)
                )
                await runner.sync_parameters()
            except BaseException as exc:
                # Tell the followers before the clique closes, so that they learn the
                # reason rather than see the clique break.
                if not isinstance(most_telling(exc), CliqueError | CliqueTimeout):
                    with anyio.CancelScope(shield=True):
                        await _abort_followers(control, phase, _why(exc, phase, stopping))
                    phase.reported = True
                raise
    return final


def _snapshot(state: Any, device: torch.device) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().to(device, copy=True) for name, tensor in state.items()}
