"""Setting a rank up: its options, flat buffers and stepper, its clique and pass runner, and
the agreement and sync every rank runs, in the same order, before the first pass."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Protocol

import anyio
import attrs
import torch

from .._effects import OnPassEvent, OptimizerFactory
from .._epoch import (
    ComputeThread,
    FlatParameters,
    PassRunner,
    StepKernel,
    Stepper,
    check_closure_free,
    check_elementwise,
)
from .._errors import ConfigError
from .._metric import metric_layout
from .._options import ModelWithData, StepOptions, Timeouts
from ..checkpoint import Resumed
from ..clique import CliqueId, Cliques
from ._agreement import agree
from ._failures import PhaseTracker

__all__ = [
    "RunOptions",
    "agree_and_sync",
    "check_rank",
    "create_flat",
    "create_stepper",
    "open_runner",
]


@attrs.frozen
class RunOptions:
    """What every rank of one entry-point call is given besides its place in the run (rank,
    device, channel, data): built once by each entry point and handed down whole, so that a
    setting added here reaches every role. The fields' types differ pairwise, so a
    positional construction that mixes them up is a type error."""

    optimizer_factory: OptimizerFactory | None
    step: StepOptions
    timeouts: Timeouts
    stop: anyio.Event | None
    cliques: Cliques | None


def check_rank(rank: int, nranks: int) -> None:
    """Raise :class:`ConfigError` unless ``0 <= rank < nranks``."""
    if nranks < 1:
        raise ConfigError(f"nranks must be >= 1 (every rank, the root included), got {nranks}")
    if not 0 <= rank < nranks:
        raise ConfigError(f"rank must be in 0..{nranks - 1} for nranks={nranks}, got {rank}")


def create_flat(
    module: torch.nn.Module, device: torch.device, nranks: int, options: StepOptions
) -> FlatParameters:
    """``module``'s flat buffers on ``device`` for a clique of ``nranks``: without gradient
    buffers for a rank alone (it exchanges nothing), laid out in ``nranks`` slices for
    ``step_on="sharded"``."""
    sharded = options.step_on == "sharded" and nranks > 1
    return FlatParameters.create(
        module,
        device,
        gradients=nranks > 1,
        shards=nranks if sharded else 1,
        bucket_cap_mb=options.bucket_cap_mb,
    )


def create_stepper(
    rank: int, optimizer_factory: OptimizerFactory, flat: FlatParameters, options: StepOptions
) -> Stepper:
    """The optimizer of ``optimizer_factory`` over the flat parameters, wrapped to step (over
    the rank's slice when ``flat`` is sharded). Raises :class:`ConfigError` for a factory that
    returns no optimizer, and with ``step_on="sharded"`` (alone too, so that a run's
    configuration fails the same way on any number of ranks) for an optimizer that cannot
    step a slice."""
    optimizer = optimizer_factory(flat.parameters)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            "optimizer_factory must return a torch.optim.Optimizer, "
            f"got {type(optimizer).__name__}",
            rank=rank,
            phase="configure",
        )
    check_closure_free(rank, optimizer)
    if options.step_on == "sharded":
        check_elementwise(rank, optimizer)
    return Stepper.create(rank, optimizer, flat, options)


class RankParts(Protocol):
    """What a role's run holds (the root's and a follower's) that opening its clique needs."""

    @property
    def nranks(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def data(self) -> ModelWithData: ...
    @property
    def step(self) -> StepOptions: ...
    @property
    def timeouts(self) -> Timeouts: ...
    @property
    def cliques(self) -> Cliques: ...
    @property
    def compute(self) -> ComputeThread: ...
    @property
    def flat(self) -> FlatParameters: ...
    @property
    def stepper(self) -> Stepper | None: ...
    @property
    def tracker(self) -> PhaseTracker: ...


@asynccontextmanager
async def open_runner(
    parts: RankParts, clique_id: CliqueId, *, rank: int, on_event: OnPassEvent | None = None
) -> AsyncIterator[PassRunner]:
    """Rank ``rank``'s clique (phase ``'clique setup'``), within ``parts.timeouts.setup``,
    and the pass runner over it, both closed with the block. Raises the clique's errors."""
    parts.tracker.current = "clique setup"
    async with parts.cliques.open(
        rank=rank,
        nranks=parts.nranks,
        device=parts.device,
        clique_id=clique_id,
        setup_timeout=parts.timeouts.setup,
        collective_timeout=parts.timeouts.collective,
    ) as clique:
        kernel = StepKernel(
            rank=rank,
            clique=clique,
            model=parts.data.model,
            flat=parts.flat,
            options=parts.step,
            stepper=parts.stepper,
        )
        yield PassRunner(kernel=kernel, compute=parts.compute, on_event=on_event)


async def agree_and_sync(
    runner: PassRunner,
    flat: FlatParameters,
    options: StepOptions,
    *,
    validates: bool,
    tracker: PhaseTracker,
    resume: Resumed | None = None,
) -> None:
    """What every rank does, in the same order, once its clique is open: :func:`agree`
    (phase ``'agreement'``), then take the root's parameters and buffers, with
    ``step_on="every_rank"`` its optimizer state (sharded: each rank's slice of the state the
    root resumed from), and its part of the checkpoint the root resumes from (``resume``, the
    root's): its place in its training data and, when the root restores RNG states, its own.

    Raises :class:`MismatchError` as :func:`agree` does, and the clique's errors.
    """
    tracker.current = "agreement"
    metrics = metric_layout(runner.kernel.model.metrics)
    await runner.run(partial(agree, runner.clique, flat, options, validates, metrics))
    await runner.sync_parameters()
    if options.step_on != "root":
        await runner.sync_optimizer_state()
    rank_states = resume.training_state.rank_states if resume is not None else None
    restore_rng = resume is not None and resume.rng_states is not None
    await runner.resume_ranks(rank_states, restore_rng=restore_rng)
