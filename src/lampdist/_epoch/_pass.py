"""The pass runner: the event loop's side of a rank's passes.

:class:`PassRunner` opens a pass's batch feed, hands the whole pass to the rank's compute
thread (:class:`~lampdist._epoch._kernel.StepKernel` runs it there), delivers its progress to
``on_event`` and awaits its end. Per pass the loop wakes up once for the result (and once per
progress event it delivers); it is never on the per-step path. Cancelling a pass stops it
between steps and aborts the clique, which frees a collective in flight.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from functools import partial
from typing import Any, TypeVar

import anyio
import attrs
import torch

from .._checkpoint import ShardedState
from .._effects import BatchSource, OnPassEvent, PassAwareBatchSource
from .._openmp import release_team
from .._options import LoopOptions
from .._source import PassContext, PassKind, pass_seed
from .._state import PassEvent, TrainingState
from .._words import counted
from ..clique import Clique
from ._compute import ComputeThread
from ._feed import BatchFeed, open_feed
from ._kernel import StepKernel
from ._objects import broadcast_object
from ._progress import Progress
from ._rank_state import RankState
from ._result import CheckpointParts, PassResult
from ._stream import StreamPosition, TrainStream, stream_context

__all__ = ["PassRunner"]

T = TypeVar("T")

logger = logging.getLogger(__name__)


@attrs.define(eq=False)
class PassRunner:
    """Runs one rank's passes: every torch operation on ``compute``, none on the loop."""

    kernel: StepKernel
    compute: ComputeThread
    loop: LoopOptions | None = None
    """The root's loop, whose ``on_event`` gets the progress, as its ``log_every_n_steps``
    and ``peak_flops`` say (followers report none)."""
    _stream: TrainStream | None = attrs.field(default=None, init=False)
    _start: StreamPosition | None = attrs.field(default=None, init=False)
    """Where the training stream starts (a resumed run's place in its data)."""

    @property
    def on_event(self) -> OnPassEvent | None:
        """The root's progress callback (followers report none)."""
        return None if self.loop is None else self.loop.on_event

    @property
    def rank(self) -> int:
        """This rank."""
        return self.kernel.rank

    @property
    def clique(self) -> Clique:
        """The rank's clique."""
        return self.kernel.clique

    @property
    def device(self) -> torch.device:
        """The rank's device."""
        return self.kernel.device

    async def prepare(self, resume: TrainingState | None = None) -> None:
        """The design's setup once every rank agreed, with the root's checkpoint to resume
        from (see :meth:`StepKernel.prepare`)."""
        await self.compute.run(partial(self.kernel.prepare, resume), on_cancel=self._abort_clique)

    async def sync_parameters(self) -> None:
        """Broadcast the root's parameters and buffers so that every rank holds them."""
        await self.compute.run(self.kernel.sync_parameters, on_cancel=self._abort_clique)

    async def sync_optimizer_state(self) -> None:
        """Give every rank the root's optimizer state (``step_on="every_rank"``), or its
        slice of the resumed state (``"sharded"``)."""
        await self.compute.run(self.kernel.sync_optimizer_state, on_cancel=self._abort_clique)

    async def checkpoint_parts(self, shards: ShardedState | None = None) -> CheckpointParts | None:
        """Gather what every rank holds of a checkpoint on the root, every rank writing its
        shards into the root's ``shards`` where the design writes shards (see
        :meth:`StepKernel.checkpoint_parts`)."""
        return await self.compute.run(
            partial(self.kernel.checkpoint_parts, shards), on_cancel=self._abort_clique
        )

    async def resume_ranks(
        self, rank_states: tuple[Mapping[str, Any], ...] | None, *, restore_rng: bool
    ) -> None:
        """Give every rank its part of the checkpoint the root resumes from: its place in its
        training stream, and with ``restore_rng`` its RNG states (the root restores its own
        from the checkpoint). ``rank_states`` is the root's (ignored elsewhere)."""

        def take() -> None:
            payload = None
            if self.rank == 0 and rank_states is not None:
                payload = {"ranks": [dict(s) for s in rank_states], "restore_rng": restore_rng}
            shared = broadcast_object(self.clique, payload, rank=self.rank)
            if shared is None:
                return
            ranks = shared["ranks"]
            if len(ranks) != self.clique.nranks:
                # Places in the data exist with steps_per_epoch only: without, there is
                # nothing to drop and so nothing to warn of. The root refused the places a
                # source's state holds (but RandomBatches'): every rank starts the pass after
                # the furthest one, so that seeded sources draw anew rather than repeat.
                passes = [rank["position"]["data_pass"] for rank in ranks if rank["position"]]
                if not passes:
                    return
                self._start = StreamPosition(data_pass=max(passes) + 1, batches=0)
                self.kernel.position = self._start
                if self.rank == 0:
                    logger.warning(
                        "the checkpoint was written by %s and this run has %d: every "
                        "rank starts its training data afresh, at pass %d over it",
                        counted(len(ranks), "rank"),
                        self.clique.nranks,
                        self._start.data_pass,
                        extra={"rank": 0},
                    )
                return
            mine = RankState.from_plain(ranks[self.rank])
            self.kernel.carried = mine.carried  # within a pass run as segments
            if mine.position is not None:
                self._start = mine.position
                self.kernel.position = self._start
            if shared["restore_rng"] and self.rank != 0:
                mine.restore_rng()

        await self.compute.run(take, on_cancel=self._abort_clique)

    def close(self) -> None:
        """Stop the training stream, if one is open (the run ends)."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    async def run(self, function: Callable[..., T], *args: object) -> T:
        """``function(*args)`` on the compute thread, for work between passes that may wait
        for the peers (the clique is aborted when the caller is cancelled meanwhile)."""
        return await self.compute.run(function, *args, on_cancel=self._abort_clique)

    async def train_pass(
        self,
        source: BatchSource | PassAwareBatchSource,
        *,
        epoch: int,
        pass_index: int,
        lr_factor: float,
        segment: tuple[int, int, int] | None = None,
    ) -> PassResult | None:
        """One training pass; the result covers the whole clique where this rank steps.
        With ``steps_per_epoch``, a window of the rank's training stream; with ``segment``,
        only that segment of the window (see :meth:`StepKernel.train_pass`; ``None`` until
        the last)."""
        if self.kernel.options.steps_per_epoch is not None:
            return await self._train_window(source, epoch, pass_index, lr_factor, segment)
        assert segment is None  # the root segments windows only
        async with self._feed(source, "train", epoch) as feed:
            return await self._train_on(feed, epoch, pass_index, lr_factor)

    async def _train_window(
        self,
        source: BatchSource | PassAwareBatchSource,
        epoch: int,
        pass_index: int,
        lr_factor: float,
        segment: tuple[int, int, int] | None,
    ) -> PassResult | None:
        release_team()
        if self._stream is None:
            options = self.kernel.options
            assert options.steps_per_epoch is not None
            accumulate = options.accumulate_gradient_over_n_batches
            self._stream = TrainStream.open(
                source,
                model=self.kernel.model,
                device=self.device,
                rank=self.rank,
                intra_op_threads=self.compute.intra_op_threads,
                window=options.steps_per_epoch * options.accumulate_gradient_over_n_batches,
                start=self._start,
                context=stream_context(options.shuffle_seed, self.rank, self.clique.nranks),
                every=None if segment is None else segment[2] * accumulate,
                into=0 if segment is None else segment[0] * accumulate,
            )
        return await self._train_on(self._stream.feed, epoch, pass_index, lr_factor, segment)

    async def _train_on(
        self,
        feed: BatchFeed,
        epoch: int,
        pass_index: int,
        lr_factor: float,
        segment: tuple[int, int, int] | None = None,
    ) -> PassResult | None:
        progress = None
        if self.loop is not None and self.on_event is not None and self.kernel.is_root:
            progress = Progress(
                every_n_steps=self.loop.log_every_n_steps, peak_flops=self.loop.peak_flops
            )

        async def run() -> PassResult | None:
            work = partial(
                self.kernel.train_pass,
                feed,
                epoch=epoch,
                pass_index=pass_index,
                lr_factor=lr_factor,
                progress=progress,
                segment=segment,
            )
            return await self.compute.run(work, on_cancel=lambda: self._stop(feed))

        if progress is None or self.on_event is None:
            return await run()
        return await _with_delivery(run, progress, self.on_event)

    async def validation_pass(
        self,
        source: BatchSource | PassAwareBatchSource,
        *,
        epoch: int,
        pass_index: int,
        validation_set: str | None = None,
        share_result: bool = False,
    ) -> PassResult:
        """One validation pass in eval mode without gradients; one reduce at the end. Its
        event names ``validation_set`` (the set it runs over; ``None``: the one source); with
        ``share_result`` every rank returns the root's result (one broadcast more)."""
        started = time.perf_counter()
        async with self._feed(source, "valid", epoch) as feed:
            work = partial(self.kernel.validation_pass, feed, epoch=epoch)
            result = await self.compute.run(work, on_cancel=lambda: self._stop(feed))
            batches = feed.batches_read
        if share_result:
            result = await self.compute.run(
                partial(self._share, result), on_cancel=self._abort_clique
            )
        if self.on_event is not None and self.kernel.is_root:
            await self.on_event(
                PassEvent(
                    epoch=epoch,
                    kind="valid",
                    pass_index=pass_index,
                    step=0,
                    batches=batches,
                    total_batches=batches,
                    examples=result.examples,
                    loss=result.loss,
                    seconds=time.perf_counter() - started,
                    done=True,
                    metrics=result.metrics,
                    validation_set=validation_set,
                )
            )
        return result

    def _share(self, result: PassResult) -> PassResult:
        """The root's ``result`` on every rank (plain values: they travel as weights_only)."""
        plain = {"loss": result.loss, "examples": result.examples, "metrics": dict(result.metrics)}
        shared = broadcast_object(self.clique, plain, rank=self.rank)
        return PassResult(
            loss=shared["loss"], examples=shared["examples"], steps=0, metrics=shared["metrics"]
        )

    def _feed(
        self, source: BatchSource | PassAwareBatchSource, phase: PassKind, epoch: int
    ) -> AbstractAsyncContextManager[BatchFeed]:
        # An effect between passes (a checkpoint, on_event) may have run parallel torch ops
        # on the loop: give its idle OpenMP team back before the pass (see ``_openmp``).
        release_team()
        seed = pass_seed(self.kernel.options.shuffle_seed, self.rank, epoch, phase)
        context = PassContext(
            epoch=epoch, kind=phase, rank=self.rank, nranks=self.clique.nranks, seed=seed
        )
        return open_feed(
            source,
            context,
            model=self.kernel.model,
            device=self.device,
            rank=self.rank,
            phase=phase,
            intra_op_threads=self.compute.intra_op_threads,
        )

    def _stop(self, feed: BatchFeed) -> None:
        """Stop a cancelled pass (a worker thread): between steps, and in a collective."""
        feed.stop()
        self._abort_clique()

    def _abort_clique(self) -> None:
        """Free a compute job that waits for its peers when this rank is cancelled."""
        self.clique.abort(f"rank {self.rank} was cancelled while training")


async def _with_delivery(
    run: Callable[[], Awaitable[T]], progress: Progress, on_event: OnPassEvent
) -> T:
    """``await run()`` while ``progress`` goes to ``on_event``; returns once the last event
    has been delivered. An error of either is raised as it is (not as a group)."""
    results: list[T] = []
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(progress.deliver, on_event)
            results.append(await run())
            progress.end()  # a segment's end has no last event
    except BaseExceptionGroup as group_error:
        errors = [
            e for e in group_error.exceptions if not isinstance(e, anyio.get_cancelled_exc_class())
        ]
        if len(errors) == 1:
            raise errors[0] from errors[0].__cause__  # as single_error() does
        raise
    return results[0]
