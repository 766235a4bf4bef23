"""One process, several devices: the root and its followers as tasks of one task group."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from contextlib import AsyncExitStack
from functools import partial
from typing import Any, Literal

import anyio
import torch

from .._effects import BatchSource, CheckpointState
from .._epoch import OnPassEvent, StepOn, SupervisedModel
from .._errors import ConfigError
from .._state import LoopState, TrainingState
from ..clique import in_process
from ..control import local_channels
from ..schedules import LearningRateSchedule
from ._common import OptimizerFactory, single_error
from ._follower import follow_distributed_training
from ._root import drive_distributed_training

__all__ = ["local_data_parallel_training_loop"]

ModelWithData = tuple[SupervisedModel, BatchSource, BatchSource | None]


async def local_data_parallel_training_loop(
    *,
    models_with_data_streams: Sequence[ModelWithData],
    optimizer_factory: OptimizerFactory,
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
    setup_timeout: float | None = 300.0,
    collective_timeout: float | None = 600.0,
) -> LoopState:
    """Train data-parallel over several devices of this process, one rank per entry.

    Each entry of ``models_with_data_streams`` is ``(model, train_batches,
    validation_batches)`` for one rank; its device is the device of its model's parameters:
    every rank on the CPU (the quickest way to try a setup), or every rank on a GPU of its
    own. The first entry is the root. Every other argument is the root's (see
    :func:`drive_distributed_training`; ``setup_timeout`` bounds nothing here: the ranks share
    an in-process clique, which needs no setup). At the end every entry's module holds the
    same weights: the best model if one was saved, else the final one. A failure in any rank
    cancels the others and is re-raised (an ``ExceptionGroup`` only for several unrelated
    failures).

    The ranks' collectives go through an in-process clique (:func:`lampdist.clique.in_process`):
    each starts once every rank has started it, for all ranks at once (one NCCL group over
    the GPUs), so no GPU runs a collective that waits for a rank that has not launched its part.
    A :class:`RuntimeWarning` for several GPUs stays until that design has been measured free
    of hangs on several GPUs (see the reliability page); for work that matters, run one
    process per GPU (:func:`lampdist.train` under torchrun).

    Raises :class:`~lampdist.ConfigError` for CPU and GPU ranks mixed or two ranks on one GPU,
    and the errors of :func:`drive_distributed_training`.
    """
    if not models_with_data_streams:
        raise ConfigError(
            "models_with_data_streams is empty: pass one (model, train, valid) per rank"
        )
    nranks = len(models_with_data_streams)
    devices = [_device_of(entry[0]) for entry in models_with_data_streams]
    cliques = in_process(devices, collective_timeout=collective_timeout)
    warn_several_gpus_in_one_process(devices)
    root, followers = local_channels(nranks)
    root_model, root_train, root_valid = models_with_data_streams[0]
    with single_error():
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(root)
            for follower in followers:
                await stack.enter_async_context(follower)
            async with anyio.create_task_group() as group:
                for rank, (follower, (model, train, valid)) in enumerate(
                    zip(followers, models_with_data_streams[1:], strict=True), start=1
                ):
                    group.start_soon(
                        partial(
                            follow_distributed_training,
                            rank=rank,
                            nranks=nranks,
                            device=devices[rank],
                            control=follower,
                            model=model,
                            train_batches=train,
                            validation_batches=valid,
                            accumulate_gradient_over_n_batches=accumulate_gradient_over_n_batches,
                            autocast_dtype=autocast_dtype,
                            step_on=step_on,
                            bucket_cap_mb=bucket_cap_mb,
                            optimizer_factory=optimizer_factory,
                            max_grad_norm=max_grad_norm,
                            non_finite_loss=non_finite_loss,
                            cliques=cliques,
                            setup_timeout=setup_timeout,
                            collective_timeout=collective_timeout,
                        )
                    )
                state = await drive_distributed_training(
                    nranks=nranks,
                    device=devices[0],
                    control=root,
                    model=root_model,
                    optimizer_factory=optimizer_factory,
                    train_batches=root_train,
                    validation_batches=root_valid,
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
                    cliques=cliques,
                    setup_timeout=setup_timeout,
                    collective_timeout=collective_timeout,
                )
    return state


def warn_several_gpus_in_one_process(devices: Sequence[torch.device]) -> None:
    """Warn when several CUDA devices share this process (see the local loop's docstring)."""
    if len({device for device in devices if device.type == "cuda"}) < 2:
        return
    warnings.warn(
        "several GPUs in one process: their in-process clique issues every collective for "
        "all of them at once (one NCCL group), which removes the deadlock that ranks issuing "
        "their own NCCL kernels ran into, but it has not yet been run on several GPUs. Run one "
        "process per GPU (lampdist.train under torchrun) for work that matters.",
        RuntimeWarning,
        stacklevel=2,
    )


def _device_of(model: SupervisedModel) -> torch.device:
    for parameter in model.module.parameters():
        return parameter.device
    raise ConfigError("a model has no parameters: lampdist trains modules with parameters")
