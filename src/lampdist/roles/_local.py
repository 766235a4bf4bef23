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
from .._errors import ConfigError
from ..control import local_channels
from ..epoch import OnPassEvent, StepOn, SupervisedModel
from ..loop import LoopState, TrainingState
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
    validation_batches)`` for one rank; its device is the device of its model's parameters
    (CPU devices work too, over Gloo, which makes this the quickest way to try a setup). The
    first entry is the root. Every other argument is the root's (see
    :func:`drive_distributed_training`). At the end every entry's module holds the same
    weights: the best model if one was saved, else the final one. A failure in any rank
    cancels the others and is re-raised (an ``ExceptionGroup`` only for several unrelated
    failures).

    Several CUDA devices in one process share the CUDA driver's locks, which couples their
    ranks: a driver call that waits for its GPU to drain while it holds a lock (the first launch
    of a kernel under lazy module loading; also copies from pageable memory and allocations,
    which touch the device's page tables) never returns when that GPU is running a collective
    that another rank of this process has not joined yet, and that rank's next driver call needs
    the same lock. NCCL's kernels wait for their peer GPUs, so this comes with driving several
    GPUs from one process (NVIDIA/nccl#750, google/jax#11637). On 2 H200 that hung 6 of about 55
    runs of a two-GPU test. ``CUDA_MODULE_LOADING=EAGER`` is no cure: with it a clique's
    teardown after a collective timeout hung in 4 of 4 runs. A :class:`RuntimeWarning` says so;
    for work that matters, run one process per GPU (:func:`lampdist.train` under torchrun).
    """
    if not models_with_data_streams:
        raise ConfigError(
            "models_with_data_streams is empty: pass one (model, train, valid) per rank"
        )
    nranks = len(models_with_data_streams)
    devices = [_device_of(entry[0]) for entry in models_with_data_streams]
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
                    setup_timeout=setup_timeout,
                    collective_timeout=collective_timeout,
                )
    return state


def warn_several_gpus_in_one_process(devices: Sequence[torch.device]) -> None:
    """Warn when several CUDA devices share this process (see the local loop's docstring)."""
    if len({device for device in devices if device.type == "cuda"}) < 2:
        return
    warnings.warn(
        "several GPUs in one process: their ranks share the CUDA driver's locks, and a driver "
        "call that waits for its GPU to drain (a kernel's first launch under lazy module "
        "loading, a copy from pageable memory, an allocation) can deadlock against a "
        "collective that another rank of the process has not joined yet (on 2 H200: 6 of "
        "about 55 runs of a two-GPU test hung; CUDA_MODULE_LOADING=EAGER made a teardown "
        "after a collective timeout hang instead). Run one process per GPU (lampdist.train "
        "under torchrun) for work that matters.",
        RuntimeWarning,
        stacklevel=2,
    )


def _device_of(model: SupervisedModel) -> torch.device:
    for parameter in model.module.parameters():
        return parameter.device
    raise ConfigError("a model has no parameters: lampdist trains modules with parameters")
