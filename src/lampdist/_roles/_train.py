"""One entry point for every rank: open the control channel, run this rank's role, stop on a
signal."""

from __future__ import annotations

import logging
import signal
import ssl
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from typing import Any, Literal, TypeVar, cast

import anyio
import torch

from .._effects import BatchSource, CheckpointState
from .._epoch import OnPassEvent, StepOn, SupervisedModel
from .._errors import Interrupted
from .._state import LoopState, TrainingState
from ..control import FollowerChannel, RootChannel
from ..launch import LaunchEnv, from_env
from ..schedules import LearningRateSchedule
from ._common import OptimizerFactory, single_error
from ._follower import follow_distributed_training
from ._root import drive_distributed_training

__all__ = ["Interrupted", "run_until_signal", "train"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""The signals that stop a run gracefully."""


async def _cancel_on_signal(scope: anyio.CancelScope, received: list[int]) -> None:
    """The stop hook: on the first SIGTERM or SIGINT, note it and cancel ``scope``.

    This is the one place that decides what a signal does to a run (a drain-and-checkpoint
    stop would go here).
    """
    with anyio.open_signal_receiver(*STOP_SIGNALS) as signals:
        async for signum in signals:
            logger.warning("received %s: stopping the run", signal.Signals(signum).name)
            received.append(signum)
            scope.cancel()
            return


async def run_until_signal(work: Callable[[], Awaitable[T]], *, rank: int | None = None) -> T:
    """Await ``work()``; SIGTERM or SIGINT cancels it and raises :class:`Interrupted`.

    The signal handlers are installed while ``work`` runs (call this from the main thread,
    as the signal APIs require). ``work`` sees an ordinary cancellation, so it releases its
    resources as it would on any cancel. Raises :class:`Interrupted` after a signal (chained
    to any error the cancelled work raised), else whatever ``work`` raises.
    """
    received: list[int] = []
    results: list[T] = []
    try:
        with single_error():  # the error of ``work``, not a group around it
            async with anyio.create_task_group() as group:
                group.start_soon(_cancel_on_signal, group.cancel_scope, received)
                results.append(await work())
                group.cancel_scope.cancel()
    except Exception as exc:
        if received:
            raise _interrupted(received[0], rank) from exc
        raise
    if received:
        raise _interrupted(received[0], rank)
    return results[0]


def _interrupted(signum: int, rank: int | None) -> Interrupted:
    name = signal.Signals(signum).name
    return Interrupted(
        f"stopped by {name}; resume from the last checkpoint",
        signum=signum,
        rank=rank,
        phase="stop",
    )


async def train(
    *,
    model: SupervisedModel,
    optimizer_factory: OptimizerFactory,
    train_batches: BatchSource,
    validation_batches: BatchSource | None = None,
    max_epochs: int,
    launch: LaunchEnv | None = None,
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
    ssl_context: ssl.SSLContext | None = None,
    stop_on_signals: bool = True,
    join_timeout: float | None = 300.0,
    setup_timeout: float | None = 300.0,
    collective_timeout: float | None = 600.0,
) -> LoopState | None:
    """Train as this process's rank: the root on rank 0, a follower elsewhere.

    One script serves every rank. ``launch`` says where this process stands; by default
    :func:`lampdist.launch.from_env` reads it from torchrun's or srun's variables. The call
    opens the control channel (:meth:`LaunchEnv.open_control`, with ``ssl_context`` for
    TLS), then runs :func:`drive_distributed_training` on rank 0, serving the clique's
    rendezvous at ``launch.host``, or :func:`follow_distributed_training` elsewhere, on
    ``launch.device``. The arguments are the union of theirs: the loop's settings
    (``max_epochs``, the schedule, ``checkpoint_state``, ``init_state``, ``on_event``, ...)
    act on the root only, and followers ignore them; give every rank the same model and the
    same ``accumulate_gradient_over_n_batches``, ``autocast_dtype``, ``step_on`` and
    ``bucket_cap_mb``.

    Returns the final :class:`~lampdist.LoopState` on the root and ``None`` on the
    followers; every rank's ``model.module`` then holds the same weights (the best model
    when ``return_min_validation_loss_model`` saved one, else the final one).

    With ``stop_on_signals`` (the default; it needs the main thread) SIGTERM or SIGINT
    cancels the training, which releases every resource and tells the other ranks, and then
    raises :class:`Interrupted`. Raises :class:`~lampdist.ConfigError` for bad arguments or
    launch variables, and every error of the role it runs (see
    :func:`drive_distributed_training` and :func:`follow_distributed_training`), an
    ``ExceptionGroup`` only for several unrelated failures.
    """
    env = launch if launch is not None else from_env()

    async def run_root(control: RootChannel) -> LoopState:
        return await drive_distributed_training(
            nranks=env.nranks,
            device=env.device,
            control=control,
            model=model,
            optimizer_factory=optimizer_factory,
            train_batches=train_batches,
            validation_batches=validation_batches,
            max_epochs=max_epochs,
            checkpoint_state=checkpoint_state,
            validation_frequency=validation_frequency,
            return_min_validation_loss_model=return_min_validation_loss_model,
            learning_rate_schedule=learning_rate_schedule,
            init_state=init_state,
            accumulate_gradient_over_n_batches=accumulate_gradient_over_n_batches,
            learning_rate_schedule_init_state=learning_rate_schedule_init_state,
            validation_loss_exponential_smoothing_factor=(
                validation_loss_exponential_smoothing_factor
            ),
            max_grad_norm=max_grad_norm,
            autocast_dtype=autocast_dtype,
            non_finite_loss=non_finite_loss,
            step_on=step_on,
            bucket_cap_mb=bucket_cap_mb,
            on_event=on_event,
            rendezvous_host=env.host,
            join_timeout=join_timeout,
            setup_timeout=setup_timeout,
            collective_timeout=collective_timeout,
        )

    async def run_follower(control: FollowerChannel) -> None:
        await follow_distributed_training(
            rank=env.rank,
            nranks=env.nranks,
            device=env.device,
            control=control,
            model=model,
            train_batches=train_batches,
            validation_batches=validation_batches,
            accumulate_gradient_over_n_batches=accumulate_gradient_over_n_batches,
            autocast_dtype=autocast_dtype,
            step_on=step_on,
            bucket_cap_mb=bucket_cap_mb,
            optimizer_factory=optimizer_factory,
            max_grad_norm=max_grad_norm,
            non_finite_loss=non_finite_loss,
            join_timeout=join_timeout,
            setup_timeout=setup_timeout,
            collective_timeout=collective_timeout,
        )

    async def run(work: Callable[[], Awaitable[T]]) -> T:
        # Only the training is cancelled on a signal, not the channel: the root still tells
        # the followers why it stops.
        if stop_on_signals:
            return await run_until_signal(work, rank=env.rank)
        return await work()

    logger.info(
        "rank %d of %d on %s, root at %s:%s",
        env.rank,
        env.nranks,
        env.device,
        env.host,
        env.port or ("a free port given through the launcher's store" if env.port_exchange else 0),
        extra={"rank": env.rank},
    )
    with single_error():
        async with env.open_control(ssl_context=ssl_context) as control:
            # open_control gives rank 0 the root's side and every other rank a follower's
            if env.is_root:
                return await run(partial(run_root, cast(RootChannel, control)))
            await run(partial(run_follower, cast(FollowerChannel, control)))
            return None
