"""One process, several devices: the root and its followers as tasks of one task group."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from contextlib import AsyncExitStack

import anyio
import torch

from .._effects import OptimizerFactory
from .._epoch import DESIGNS
from .._errors import ConfigError
from .._metric import Metric
from .._model import BatchModel
from .._options import LoopOptions, ModelWithData, StepOptions, Timeouts
from .._preload import preload
from .._state import LoopState
from ..checkpoint import Resumed
from ..clique import in_process
from ..control import local_channels
from ._failures import single_error
from ._follower import follow
from ._rank import RunOptions
from ._root import drive

__all__ = ["local_data_parallel_training_loop", "run_locally"]


async def local_data_parallel_training_loop(
    *,
    models_with_data_streams: Sequence[ModelWithData],
    optimizer_factory: OptimizerFactory,
    loop: LoopOptions,
    step: StepOptions = StepOptions(),
    timeouts: Timeouts = Timeouts(),
    resume: Resumed | None = None,
    stop: anyio.Event | None = None,
) -> LoopState:
    """Train data-parallel over several devices of this process, one rank per entry.

    Each :class:`~lampdist.ModelWithData` of ``models_with_data_streams`` is one rank; its
    device is the device of its model's parameters: every rank on the CPU (the quickest way
    to try a setup), or every rank on a GPU of its own. The first entry is the root. The
    other arguments are those of :func:`drive_distributed_training` (``timeouts.setup`` and
    ``timeouts.join`` bound nothing here: the ranks share an in-process clique and channels,
    which need no setup). At the end every entry's module holds the same weights: the best
    model if one was saved, else the final one. A failure in any rank cancels the others and
    is re-raised (an ``ExceptionGroup`` only for several unrelated failures).

    The ranks' collectives go through an in-process clique (:func:`lampdist.clique.in_process`):
    each starts once every rank has started it, for all ranks at once (one NCCL group over
    the GPUs), so no GPU runs a collective that waits for a rank that has not launched its part.
    Several GPUs get a :class:`RuntimeWarning` (the reliability page says why); for work that
    matters, run one process per GPU (:func:`lampdist.train` under torchrun).

    Raises :class:`~lampdist.ConfigError` for ``step_on="fsdp"`` (one process per rank), for
    CPU and GPU ranks mixed or two ranks on one GPU,
    for a torchmetrics metric object given to two ranks (each rank updates its own), and the
    errors of :func:`drive_distributed_training`.
    """
    args = (models_with_data_streams, optimizer_factory, loop, step, timeouts, resume, stop)
    return await run_locally(*args)


async def run_locally(
    models_with_data_streams: Sequence[ModelWithData],
    optimizer_factory: OptimizerFactory,
    loop: LoopOptions,
    step: StepOptions,
    timeouts: Timeouts,
    resume: Resumed | None,
    stop: anyio.Event | None,
    *,
    evaluating: bool = False,
) -> LoopState:
    """:func:`local_data_parallel_training_loop`'s work (``evaluating``: see ``drive``)."""
    if not models_with_data_streams:
        raise ConfigError(
            "models_with_data_streams is empty: pass one ModelWithData(model, train_batches, "
            "validation_batches) per rank"
        )
    if DESIGNS[step.step_on].own_process:
        raise ConfigError(
            f"step_on={step.step_on!r} needs one process per rank (torch allows one default "
            "process group, which FSDP2 shards over, per process): run lampdist.train under "
            "torchrun, or the root's driver and the followers in processes of their own",
            phase="configure",
        )
    nranks = len(models_with_data_streams)
    _check_own_metrics(models_with_data_streams)
    await preload()
    devices = [_device_of(entry.model) for entry in models_with_data_streams]
    cliques = in_process(devices, collective_timeout=timeouts.collective)
    run = RunOptions(optimizer_factory, step, timeouts, cliques)
    warn_several_gpus_in_one_process(devices)
    root, followers = local_channels(nranks)
    with single_error():
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(root)
            for follower in followers:
                await stack.enter_async_context(follower)
            async with anyio.create_task_group() as group:
                for rank, (follower, data) in enumerate(
                    zip(followers, models_with_data_streams[1:], strict=True), start=1
                ):
                    # The root's stop stops every rank (its STOP): a follower needs none.
                    group.start_soon(follow, rank, nranks, devices[rank], follower, data, run)
                first = models_with_data_streams[0]
                state = await drive(
                    nranks, devices[0], root, first, run, loop, resume, stop, evaluating=evaluating
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


def _check_own_metrics(entries: Sequence[ModelWithData]) -> None:
    """Raise :class:`ConfigError` when two ranks share a stateful (torchmetrics) metric."""
    owner: dict[int, int] = {}
    for rank, entry in enumerate(entries):
        for name, metric in entry.model.metrics.items():
            if isinstance(metric, Metric):
                continue  # a function: nothing to share
            first = owner.setdefault(id(metric), rank)
            if first != rank:
                raise ConfigError(
                    f"ranks {first} and {rank} share the metric object {name!r}: each rank "
                    "updates its own, give each SupervisedModel a new one",
                    rank=rank,
                    phase="configure",
                )


def _device_of(model: BatchModel) -> torch.device:
    for parameter in model.module.parameters():
        return parameter.device
    raise ConfigError("a model has no parameters: lampdist trains modules with parameters")
