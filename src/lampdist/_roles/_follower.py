"""The follower: join, open the clique, run the pass the root commands, until STOP."""

from __future__ import annotations

import logging
import math
from functools import partial
from typing import Literal

import anyio
import torch
from anyio.streams.memory import MemoryObjectReceiveStream

from .._effects import BatchSource
from .._epoch import (
    ComputeThread,
    FlatModel,
    RankRunner,
    StepKernel,
    StepOn,
    Stepper,
    SupervisedModel,
    TrainingOptions,
    open_compute_thread,
)
from .._errors import (
    CliqueError,
    CliqueTimeout,
    ConfigError,
    LampdistError,
    MismatchError,
    PeerDisconnected,
    RankFailed,
)
from ..clique import Cliques, ProcessGroups
from ..control import Command, CommandKind, FollowerChannel
from ._common import (
    CULPRIT_TIMEOUT,
    DERIVED,
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

__all__ = ["follow_distributed_training"]

logger = logging.getLogger(__name__)

REPORT_TIMEOUT = 1.0

ROOT_REASON_TIMEOUT = 2 * CULPRIT_TIMEOUT + 1.0
"""How long a follower whose collective failed waits for the root's reason; the root itself
first waits up to CULPRIT_TIMEOUT for the control channel to name a culprit."""


async def follow_distributed_training(
    *,
    rank: int,
    nranks: int,
    device: torch.device | str | int,
    control: FollowerChannel,
    model: SupervisedModel,
    train_batches: BatchSource,
    validation_batches: BatchSource | None = None,
    accumulate_gradient_over_n_batches: int = 1,
    autocast_dtype: torch.dtype | None = None,
    step_on: StepOn = "root",
    bucket_cap_mb: float | None = None,
    optimizer_factory: OptimizerFactory | None = None,
    max_grad_norm: float | None = None,
    non_finite_loss: Literal["raise", "skip"] = "raise",
    cliques: Cliques | None = None,
    join_timeout: float | None = 300.0,
    setup_timeout: float | None = 300.0,
    collective_timeout: float | None = 600.0,
) -> None:
    """Follow a data-parallel training run as rank ``rank`` (1..nranks-1) until the root stops it.

    The follower joins through ``control`` (within ``join_timeout``), opens the clique on
    ``device`` with the clique id the root published, and for each command runs one training
    or validation pass over its own batches. It holds no optimizer: each step sends its
    example-weighted gradients to the root and receives the root's parameters. On STOP it
    receives the final (or best) weights into ``model.module`` and returns.

    ``accumulate_gradient_over_n_batches``, ``autocast_dtype``, ``step_on`` and
    ``bucket_cap_mb`` must equal the root's, and ``cliques`` must be the root's kind (process
    groups by default; the in-process cliques shared with a root in this process).
    Raises :class:`~lampdist.MismatchError` when this rank disagrees with the root,
    :class:`~lampdist.RankFailed` when the root (rank 0) aborts the run, naming its error,
    :class:`~lampdist.PeerDisconnected` when the root vanishes, and the errors of this
    rank's own training (:class:`~lampdist.TrainingError`), which it also reports to the root.
    Several unrelated failures at once come as an ``ExceptionGroup``.
    """
    check_rank(rank, nranks)
    if rank == 0:
        raise ConfigError("rank 0 is the root: call drive_distributed_training for it")
    torch_device = resolve_device(device)
    options = TrainingOptions(
        accumulate_gradient_over_n_batches=accumulate_gradient_over_n_batches,
        autocast_dtype=autocast_dtype,
        step_on=step_on,
        bucket_cap_mb=bucket_cap_mb,
        max_grad_norm=max_grad_norm,
        non_finite_loss=non_finite_loss,
    )
    if step_on == "every_rank" and optimizer_factory is None:
        raise ConfigError(
            "step_on='every_rank' needs optimizer_factory on the followers too: pass the root's",
            rank=rank,
            phase="configure",
        )
    async with open_compute_thread(rank, torch_device) as compute:
        # On the compute thread: the control channel must keep answering meanwhile.
        flat = await compute.run(FlatModel.create, model.module, torch_device)
        stepper = None
        if step_on == "every_rank":
            assert optimizer_factory is not None
            stepper = await compute.run(create_stepper, rank, optimizer_factory, flat, options)
        phase = Phase("join")
        send, receive = anyio.create_memory_object_stream[Command](math.inf)
        with single_error():
            async with anyio.create_task_group() as group, receive:
                group.start_soon(watch_peers, control.watch, phase)
                try:
                    await _run(
                        rank=rank,
                        nranks=nranks,
                        device=torch_device,
                        control=control,
                        model=model,
                        compute=compute,
                        flat=flat,
                        options=options,
                        stepper=stepper,
                        train_batches=train_batches,
                        validation_batches=validation_batches,
                        commands=receive,
                        cliques=cliques or ProcessGroups(),
                        join_timeout=join_timeout,
                        setup_timeout=setup_timeout,
                        collective_timeout=collective_timeout,
                        phase=phase,
                        send=send,
                    )
                except Exception as exc:
                    leaf = most_telling(exc)
                    if isinstance(leaf, CliqueError | CliqueTimeout):
                        culprit = await _find_culprit(receive, control, phase)
                        if culprit is not None:
                            raise culprit from leaf
                    if not phase.reported and _root_must_hear(leaf):
                        # Only an original error: a failed or timed-out collective here is the
                        # consequence of a failure elsewhere, and the root must not blame us.
                        with anyio.CancelScope(shield=True):
                            await _report(control, phase.name, exc)
                    raise
                group.cancel_scope.cancel()


async def _report(control: FollowerChannel, phase: str, error: BaseException) -> None:
    """Best effort: tell the root why this rank stops."""
    with anyio.move_on_after(REPORT_TIMEOUT):
        try:
            await control.report_failure(phase, describe(error))
        except LampdistError as exc:
            logger.debug("could not report the failure to the root: %s", exc)


async def _find_culprit(
    commands: MemoryObjectReceiveStream[Command], control: FollowerChannel, phase: Phase
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
        error = await find_culprit(control.watch, phase)
        if found is None:
            found = error
        if error is not None:
            scope.cancel()

    with anyio.move_on_after(ROOT_REASON_TIMEOUT):
        async with anyio.create_task_group() as group:
            group.start_soon(from_root, group.cancel_scope)
            group.start_soon(from_channel, group.cancel_scope)
    return found


async def _run(
    *,
    rank: int,
    nranks: int,
    device: torch.device,
    control: FollowerChannel,
    model: SupervisedModel,
    compute: ComputeThread,
    flat: FlatModel,
    options: TrainingOptions,
    stepper: Stepper | None,
    train_batches: BatchSource,
    validation_batches: BatchSource | None,
    commands: MemoryObjectReceiveStream[Command],
    send: anyio.abc.ObjectSendStream[Command],
    cliques: Cliques,
    join_timeout: float | None,
    setup_timeout: float | None,
    collective_timeout: float | None,
    phase: Phase,
) -> None:
    clique_id = await control.join(send, timeout=join_timeout)
    phase.name = "clique setup"
    async with cliques.open(
        nranks=nranks,
        rank=rank,
        device=device,
        clique_id=clique_id,
        setup_timeout=setup_timeout,
        collective_timeout=collective_timeout,
    ) as clique:
        kernel = StepKernel(
            rank=rank, clique=clique, model=model, flat=flat, options=options, stepper=stepper
        )
        runner = RankRunner(kernel=kernel, compute=compute)
        try:
            await _follow_commands(runner, commands, train_batches, validation_batches, phase)
        except Exception as exc:
            # Report before the clique closes, so the root learns the cause before the
            # collectives on other ranks fail.
            if _root_must_hear(most_telling(exc)):
                with anyio.CancelScope(shield=True):
                    await _report(control, phase.name, exc)
            phase.reported = True
            raise


def _root_must_hear(error: BaseException) -> bool:
    """Whether the root learns of ``error`` only from this rank: not for the consequence of a
    failure elsewhere, nor for a disagreement, which the agreement check raises on every rank
    (the root's own MismatchError is the clearer error there)."""
    agreed = isinstance(error, MismatchError) and error.phase == "agreement"
    return not agreed and not isinstance(error, DERIVED)


async def _follow_commands(
    runner: RankRunner,
    commands: MemoryObjectReceiveStream[Command],
    train_batches: BatchSource,
    validation_batches: BatchSource | None,
    phase: Phase,
) -> None:
    phase.name = "agreement"
    kernel = runner.kernel
    validates = validation_batches is not None
    agreement = partial(agree, kernel.clique, kernel.flat, kernel.options, validates=validates)
    await runner.run(agreement)
    await runner.sync_parameters()
    if kernel.options.step_on == "every_rank":
        await runner.sync_optimizer_state()
    phase.name = "wait for command"
    async for command in commands:
        if command.kind is CommandKind.STOP:
            if command.error is not None:
                raise RankFailed(command.error, rank=0, phase="stop")
            phase.name = "stop"
            await runner.sync_parameters()
            return
        if command.kind is CommandKind.TRAIN:
            phase.name = "train"
            await runner.train_pass(
                train_batches,
                epoch=command.epoch,
                pass_index=command.pass_index,
                lr_factor=command.lr_factor if command.lr_factor is not None else 1.0,
            )
        elif command.kind is CommandKind.VALID:
            phase.name = "valid"
            assert validation_batches is not None  # the agreement check ensures it
            await runner.validation_pass(
                validation_batches, epoch=command.epoch, pass_index=command.pass_index
            )
        phase.name = "wait for command"
    raise PeerDisconnected(
        "the root closed the control channel without STOP", rank=0, phase=phase.name
    )
