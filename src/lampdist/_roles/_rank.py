"""One rank's context: what the root and a follower share, built once by :func:`open_rank`.

A :class:`RankContext` holds the rank's place (rank, clique size, device), its data, the one
:class:`RunOptions` value of the entry point (each component reads its own section of it), the
compute thread, the stepping design (see ``lampdist._epoch._designs``), where its cliques come
from, its phase tracker and its graceful stop. The roles are thin on top of it: the root
rendezvouses and drives the epochs, a follower joins and runs commands; both open their
clique (:meth:`RankContext.open_clique`), agree and sync (:meth:`RankContext.agree_and_sync`)
and run under the same supervision (:meth:`RankContext.supervised`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from functools import partial

import anyio
import attrs
import torch

from .._effects import OptimizerFactory
from .._epoch import (
    DESIGNS,
    ComputeThread,
    Design,
    PassRunner,
    StepKernel,
    create_design,
    open_compute_thread,
)
from .._errors import ConfigError
from .._metric import metric_layout
from .._options import LoopOptions, ModelWithData, StepOptions, Timeouts
from .._random_batches import check_pass_ends
from ..checkpoint import Resumed
from ..clique import CliqueFactory, CliqueId, ProcessGroups, in_process
from ._agreement import agree
from ._failures import PhaseTracker, single_error
from ._stopping import Stopping

__all__ = [
    "RankContext",
    "RunOptions",
    "check_optimizer_factory",
    "check_rank",
    "open_rank",
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
    cliques: CliqueFactory | None


def check_rank(rank: int, nranks: int) -> None:
    """Raise :class:`ConfigError` unless ``0 <= rank < nranks``."""
    if nranks < 1:
        raise ConfigError(f"nranks must be >= 1 (every rank, the root included), got {nranks}")
    if not 0 <= rank < nranks:
        raise ConfigError(f"rank must be in 0..{nranks - 1} for nranks={nranks}, got {rank}")


def check_optimizer_factory(rank: int, options: RunOptions) -> None:
    """Raise :class:`ConfigError` when rank ``rank`` steps (the root; every rank of a design
    whose followers step) and ``options`` has no optimizer factory."""
    if options.optimizer_factory is not None:
        return
    if rank == 0:
        raise ConfigError("the root needs an optimizer_factory", rank=0, phase="configure")
    step_on = options.step.step_on
    if DESIGNS[step_on].followers_step:
        raise ConfigError(
            f"step_on={step_on!r} needs optimizer_factory on the followers too: pass the root's",
            rank=rank,
            phase="configure",
        )


@attrs.define(eq=False)
class RankContext:
    """What the root and a follower share for one run (see the module docstring)."""

    rank: int
    nranks: int
    device: torch.device
    data: ModelWithData
    options: RunOptions
    compute: ComputeThread
    design: Design
    cliques: CliqueFactory
    stop: anyio.Event | None = None
    """The graceful stop's request (see :class:`Stopping`): an input of the run, not one
    of its options."""
    tracker: PhaseTracker = attrs.field(factory=lambda: PhaseTracker("join"))
    stopping: Stopping = attrs.field()

    @stopping.default
    def _default_stopping(self) -> Stopping:
        return Stopping(self.stop, self.options.timeouts.stop, rank=self.rank)

    @property
    def timeouts(self) -> Timeouts:
        """The run's deadlines."""
        return self.options.timeouts

    @asynccontextmanager
    async def open_clique(
        self, clique_id: CliqueId, *, loop: LoopOptions | None = None
    ) -> AsyncIterator[PassRunner]:
        """The rank's clique (phase ``'clique setup'``), within ``timeouts.setup``, and the
        pass runner over it, reporting as the root's ``loop`` says, both closed with the
        block. Raises the clique's errors."""
        self.tracker.current = "clique setup"
        async with self.cliques.open(
            rank=self.rank,
            nranks=self.nranks,
            device=self.device,
            clique_id=clique_id,
            setup_timeout=self.timeouts.setup,
            collective_timeout=self.timeouts.collective,
        ) as clique:
            kernel = StepKernel(
                rank=self.rank, clique=clique, model=self.data.model, design=self.design
            )
            yield PassRunner(kernel=kernel, compute=self.compute, loop=loop)

    async def agree_and_sync(self, runner: PassRunner, *, resume: Resumed | None = None) -> None:
        """What every rank does, in the same order, once its clique is open: :func:`agree`
        (phase ``'agreement'``), then the design's setup with the root's checkpoint
        (:meth:`Design.prepare`: fsdp shards the model and loads its shards there), then take
        the root's parameters and buffers, the optimizer state its design starts from (see
        :meth:`Design.sync_optimizer_state`), and its part of the checkpoint the root resumes
        from (``resume``, the root's): its place in its training data and, when the root
        restores RNG states, its own.

        Raises :class:`MismatchError` as :func:`agree` does, and the clique's errors.
        """
        self.tracker.current = "agreement"
        data, flat, step = self.data, self.design.flat, self.options.step
        validates = data.validation_batches is not None
        metrics = [*metric_layout(data.model.metrics), ("mean_over", data.model.mean_over)]
        sets = data.validation_sets
        await runner.run(partial(agree, runner.clique, flat, step, validates, metrics, sets))
        await runner.prepare(resume.training_state if resume is not None else None)
        await runner.sync_parameters()
        await runner.sync_optimizer_state()
        rank_states = resume.training_state.rank_states if resume is not None else None
        restore_rng = resume is not None and resume.rng_states is not None
        await runner.resume_ranks(rank_states, restore_rng=restore_rng)

    @asynccontextmanager
    async def supervised(
        self,
        watch: Callable[[], Coroutine[object, object, None]],
        on_error: Callable[[BaseException], Awaitable[None]],
    ) -> AsyncIterator[None]:
        """Run the block beside ``watch`` (which raises when a peer fails, cancelling it) and
        the graceful stop's deadline (:meth:`Stopping.enforce`); raise the stop's timeout when
        the stop abandoned the run. ``on_error`` is awaited with the block's error, beside the
        watch still, before the error is raised (a role tells its peers there). One error
        comes out, not a group (see :func:`single_error`)."""
        with single_error():
            async with anyio.create_task_group() as group:
                group.start_soon(watch)
                if self.stopping.stop is not None:
                    group.start_soon(self.stopping.enforce, self.tracker)
                try:
                    with self.stopping.scope:
                        yield
                    self.stopping.check_abandoned()
                except BaseException as exc:
                    await on_error(exc)
                    raise
                group.cancel_scope.cancel()


def _cliques(rank: int, nranks: int, device: torch.device, options: RunOptions) -> CliqueFactory:
    """Where the rank's cliques come from: ``options.cliques``, or by default an in-process
    clique for a rank alone and process groups otherwise. fsdp needs process groups that open
    torch's default group (see :class:`ProcessGroups`), on any number of ranks."""
    cliques = options.cliques
    step_on = options.step.step_on
    if DESIGNS[step_on].own_process:
        if cliques is None:
            return ProcessGroups(default_group=True)
        if isinstance(cliques, ProcessGroups):
            return attrs.evolve(cliques, default_group=True)
        raise ConfigError(
            f"step_on={step_on!r} needs one process per rank over process groups, not "
            f"{type(cliques).__name__} cliques: pass cliques=None or ProcessGroups(...)",
            rank=rank,
            phase="configure",
        )
    if cliques is None:
        collective = options.timeouts.collective
        if nranks == 1:
            return in_process([device], collective_timeout=collective)
        return ProcessGroups()
    return cliques


@asynccontextmanager
async def open_rank(
    rank: int,
    nranks: int,
    device: torch.device,
    data: ModelWithData,
    options: RunOptions,
    stop: anyio.Event | None = None,
) -> AsyncIterator[RankContext]:
    """Rank ``rank``'s context (see :class:`RankContext`): its compute thread, and on it the
    design for ``options.step`` (the model moved to ``device`` and laid out flat, the
    optimizer built where the rank steps: that can take seconds, and the control channel
    must keep answering meanwhile). Without ``options.cliques``, a rank alone gets an in-process
    clique of one rank (no process group, store or thread behind it), and a clique of
    several ranks process groups. ``options.step``'s ``global_accumulation`` is resolved
    into the per-rank count here, once (:meth:`StepOptions.per_rank`). Raises
    :class:`ConfigError` as :func:`create_design` does, for a ``global_accumulation``
    that ``nranks`` does not divide, and for a training source whose pass would never end
    (:func:`check_pass_ends`)."""
    options = attrs.evolve(options, step=options.step.per_rank(nranks, rank=rank))
    check_pass_ends(data.train_batches, options.step.steps_per_epoch, rank=rank)
    cliques = _cliques(rank, nranks, device, options)
    async with open_compute_thread(rank, device) as compute:
        design = await compute.run(
            partial(
                create_design,
                rank=rank,
                nranks=nranks,
                module=data.model.module,
                device=device,
                options=options.step,
                optimizer_factory=options.optimizer_factory,
            )
        )
        yield RankContext(
            rank=rank,
            nranks=nranks,
            device=device,
            data=data,
            options=options,
            compute=compute,
            design=design,
            cliques=cliques,
            stop=stop,
        )
