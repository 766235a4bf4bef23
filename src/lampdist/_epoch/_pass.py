"""The pass runner: the event loop's side of a rank's passes.

:class:`PassRunner` opens a pass's batch feed, hands the whole pass to the rank's compute
thread (:class:`~lampdist._epoch._kernel.StepKernel` runs it there), delivers its progress to
``on_event`` and awaits its end. Per pass the loop wakes up once for the result (and once per
progress event it delivers); it is never on the per-step path. Cancelling a pass stops it
between steps and aborts the clique, which frees a collective in flight.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from functools import partial
from typing import TypeVar

import anyio
import attrs
import torch

from .._effects import BatchSource, OnPassEvent, PassAwareBatchSource
from .._openmp import release_team
from .._source import PassContext, PassKind, pass_seed
from .._state import PassEvent
from ..clique import Clique
from ._compute import ComputeThread
from ._feed import BatchFeed, open_feed
from ._kernel import StepKernel
from ._progress import Progress
from ._result import PassResult

__all__ = ["PassRunner"]

T = TypeVar("T")


@attrs.define(eq=False)
class PassRunner:
    """Runs one rank's passes: every torch operation on ``compute``, none on the loop."""

    kernel: StepKernel
    compute: ComputeThread
    on_event: OnPassEvent | None = None
    """The root's progress callback (followers report none)."""

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

    async def sync_parameters(self) -> None:
        """Broadcast the root's parameters and buffers so that every rank holds them."""
        await self.compute.run(self.kernel.sync_parameters, on_cancel=self._abort_clique)

    async def sync_optimizer_state(self) -> None:
        """Give every rank the root's optimizer state (``step_on="every_rank"``), or its
        slice of the resumed state (``"sharded"``)."""
        await self.compute.run(self.kernel.sync_optimizer_state, on_cancel=self._abort_clique)

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
        gather_state: bool = False,
    ) -> PassResult:
        """One training pass; the result covers the whole clique where this rank steps.
        ``gather_state``: see :meth:`StepKernel.train_pass`."""
        async with self._feed(source, "train", epoch) as feed:
            progress = None
            if self.on_event is not None and self.kernel.is_root:
                progress = Progress()

            async def run() -> PassResult:
                work = partial(
                    self.kernel.train_pass,
                    feed,
                    epoch=epoch,
                    pass_index=pass_index,
                    lr_factor=lr_factor,
                    progress=progress,
                    gather_state=gather_state,
                )
                return await self.compute.run(work, on_cancel=lambda: self._stop(feed))

            if progress is None or self.on_event is None:
                return await run()
            return await _with_delivery(run, progress, self.on_event)

    async def validation_pass(
        self, source: BatchSource | PassAwareBatchSource, *, epoch: int, pass_index: int
    ) -> PassResult:
        """One validation pass in eval mode without gradients; one reduce at the end."""
        started = time.perf_counter()
        async with self._feed(source, "valid", epoch) as feed:
            work = partial(self.kernel.validation_pass, feed, epoch=epoch)
            result = await self.compute.run(work, on_cancel=lambda: self._stop(feed))
            batches = feed.batches_read
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
                )
            )
        return result

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
    except BaseExceptionGroup as group_error:
        errors = [
            e for e in group_error.exceptions if not isinstance(e, anyio.get_cancelled_exc_class())
        ]
        if len(errors) == 1:
            raise errors[0] from errors[0].__cause__  # as single_error() does
        raise
    return results[0]
