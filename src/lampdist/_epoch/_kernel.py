"""The step kernel: a rank's passes as plain loops on its compute thread.

Every method of :class:`StepKernel` runs on the rank's compute thread (see ``_compute``), the
thread that launches the kernels: take the next step's batches from the feed, forward,
backward, exchange, step, publish progress, repeat. The event loop only starts a pass and
awaits its end (see ``_pass``), so it never touches the device.

The kernel holds the pass loops and the model code (see ``_model_code``); each training step
is the rank's design's (see ``_designs``: a rank alone, stepping on the root, on every rank, or
sharded), which takes the batches, runs the kernel's model code on them, exchanges the
gradients and steps. Whatever the design, the update equals one process stepping on the
concatenation of every rank's batches of the step. The pass ends when no rank has batches
left. A training pass's telemetry (the step split, tokens, FLOPs, progress events, gradient
norms, stragglers) is the pass's watch's, which the loop notifies (see ``_watch``); what a
pass asks of the other ranks goes through the kernel's peers, none for a rank alone, decided
once when the kernel is made (see ``_peers``).

The model's metrics (see ``_metrics``) are updated from each batch's output on the device and
summed over the clique once a pass: behind the validation pass's examples and loss in its one
reduce, and at the end of a training pass in one reduce of their own (not behind each step's
gradients, whose tail is summed in the gradients' dtype).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import torch

from .._checkpoint import FileRecord, ShardedState
from .._errors import TrainingError
from .._model import BatchModel
from .._options import StepOptions
from .._state import TrainingState
from .._wakeup import on_event_loop_thread
from ..clique import Clique
from ._clock import FORWARD_BACKWARD
from ._designs import Design, StepBatches
from ._device import host_to_device
from ._feed import BatchFeed, LoadedBatch, PassStopped
from ._metrics import MetricTally
from ._model_code import ModelCode
from ._objects import gather_objects
from ._peers import Peers, peers_of
from ._progress import Progress
from ._rank_state import RankState
from ._result import CheckpointParts, PassResult
from ._segments import carried, carry_on
from ._stream import StreamPosition
from ._tally import ReadBack, Tally
from ._watch import PassWatch, TrainTelemetry

__all__ = ["StepKernel"]


@attrs.frozen
class _TrainRun:
    """One training pass as its loop and its end share it (see :meth:`StepKernel.train_pass`)."""

    feed: BatchFeed
    epoch: int
    tally: Tally
    metrics: MetricTally | None
    watch: PassWatch
    step: Callable[[int], bool]
    """Runs step ``n`` (from 0); returns whether another step follows."""


@attrs.define(eq=False)
class StepKernel:
    """One rank's passes on its compute thread, stepping by ``design``, which it connects to
    ``clique``.

    Every method runs on the compute thread, which owns every field: the event loop reads
    none of them while a pass runs.
    """

    rank: int
    clique: Clique
    model: BatchModel
    design: Design
    _peers: Peers = attrs.field(init=False)
    """What a pass asks of the other ranks (nothing for a rank alone)."""
    _code: ModelCode = attrs.field(init=False)
    """The model code the passes run on each batch."""
    _telemetry: TrainTelemetry = attrs.field(init=False)
    """The training passes' telemetry (see ``_watch``)."""
    _read_back: ReadBack | None = attrs.field(default=None, init=False)
    """The tallies' ring and buffers on CUDA, reused from pass to pass."""
    position: StreamPosition | None = attrs.field(default=None, init=False)
    """With ``steps_per_epoch``: the rank's place in its training stream after the last
    window or segment (what a checkpoint stores)."""
    _open: tuple[_TrainRun, int] | None = attrs.field(default=None, init=False)
    """A pass run as segments (see ``_segments``) whose last segment has not run, and the
    step it goes on from."""
    carried: dict[str, Any] | None = attrs.field(default=None, init=False)
    """The running sums of the pass that the next segment goes on from, after a recovery
    within it (the snapshot's; see :meth:`PassRunner.resume_ranks`)."""

    def __attrs_post_init__(self) -> None:
        self.design.connect(self.clique)
        self._peers = peers_of(self.clique, self.rank, lockstep=self.design.lockstep)
        self._code = ModelCode(
            self.rank, self.clique, self.model, self.design, lockstep=self._peers.lockstep
        )
        self._telemetry = TrainTelemetry.create(
            self.rank, self.design, self.model, self.device, self.clique.nranks
        )
        if self.device.type == "cuda":
            self._read_back = ReadBack(self.device)

    @property
    def options(self) -> StepOptions:
        """How every rank steps."""
        return self.design.options

    @property
    def device(self) -> torch.device:
        """The rank's device."""
        return self.clique.device

    @property
    def is_root(self) -> bool:
        """Whether this is rank 0."""
        return self.rank == 0

    @property
    def alone(self) -> bool:
        """Whether the clique has this rank only (collectives are skipped)."""
        return self.clique.nranks == 1

    # -- between passes ----------------------------------------------------------------------

    def _check_thread(self) -> None:
        """Refuse to run on an event loop: the kernel waits for peers and for the device."""
        if on_event_loop_thread():
            raise RuntimeError(
                f"rank {self.rank}: the step kernel runs on the rank's compute thread, not on "
                "an event loop; start passes through PassRunner"
            )

    def prepare(self, resume: TrainingState | None) -> None:
        """The design's setup once every rank agreed (see :meth:`Design.prepare`)."""
        self._check_thread()
        self.design.prepare(resume)

    def sync_parameters(self) -> None:
        """Broadcast the root's parameters and buffers so that every rank holds them (the
        flat buffers, and the module's other buffers: an fsdp model's shards are the root's
        by construction)."""
        self._check_thread()
        flat = self.design.flat
        tensors = [*flat.parameter_buffers, *flat.module_buffers]
        if not self.alone and tensors:
            self.clique.start_broadcast(tensors).wait_blocking(None)

    def sync_optimizer_state(self) -> None:
        """Give every stepping rank the optimizer state it starts from (see
        :meth:`Design.sync_optimizer_state`)."""
        self._check_thread()
        self.design.sync_optimizer_state()

    def checkpoint_parts(self, shards: ShardedState | None = None) -> CheckpointParts | None:
        """What each rank holds of a checkpoint, gathered on the root (``None`` elsewhere):
        the whole optimizer state (see :meth:`Design.checkpoint_optimizer_state`), or where
        the design writes shards (fsdp) into the root's ``shards``, every rank's files; and
        every rank's own state (:class:`RankState`: its place in its training stream and its
        RNG states). Every rank calls it, between passes."""
        self._check_thread()
        optimizer_state = self.design.checkpoint_optimizer_state()
        records = self.design.checkpoint_shards(shards)
        mine = RankState.capture(self.position, self._carried()).to_plain()
        ranks = gather_objects(self.clique, [mine, records], rank=self.rank)
        if ranks is None:
            return None
        assert optimizer_state is not None
        return CheckpointParts(
            optimizer_state=optimizer_state,
            rank_states=tuple(state for state, _ in ranks),
            shard_records=tuple(
                FileRecord(name=name, size=size, digests=tuple(digests))
                for _, files in ranks
                for name, size, digests in files
            ),
        )

    # -- the training pass -------------------------------------------------------------------

    def train_pass(
        self,
        feed: BatchFeed,
        *,
        epoch: int,
        pass_index: int,
        lr_factor: float,
        progress: Progress | None,
        segment: tuple[int, int, int] | None = None,
    ) -> PassResult | None:
        """One training pass over ``feed``; the result covers the whole clique where this
        rank steps. ``progress`` (the root's) gets an event after every step. With
        ``steps_per_epoch`` the pass is that many steps over the rank's training stream, and
        ``learning_rate_per_step`` scales each step's learning rate. With ``segment``
        (``(first, stop, length)``, see ``_segments``) only the pass's steps ``[first, stop)``,
        going on from the segment before: ``None`` until the last. Raises
        :class:`PassStopped` between steps once the feed is stopped."""
        self._check_thread()
        first, stop = (0, None) if segment is None else segment[:2]
        run = self._resumed(first, progress)
        if run is None:
            run = self._start_pass(feed, epoch, pass_index, lr_factor, progress)
            if first:
                self._carry_on(run, first)
        one_step, watch = run.step, run.watch
        with self.design.attached():
            step, more = first, True
            while more and step != stop:
                more = one_step(step)
                step += 1
                watch.stepped(more)
        if more:  # a segment's end: the pass goes on with the next
            self.design.settle()
            run.tally.drain()
            self.position = run.feed.position
            self._open = (run, step)
            return None
        return self._finish_pass(run, steps=step)

    def _resumed(self, first: int, progress: Progress | None) -> _TrainRun | None:
        """The open pass that a segment from step ``first`` goes on with, if any."""
        opened, self._open = self._open, None
        if opened is None or first == 0:
            return None
        run, step = opened
        if step != first:
            raise AssertionError(f"a segment from step {first} after one that ended at {step}")
        run.watch.progress = progress  # the segment's
        self.design.clock = run.watch.clock
        return run

    def _carried(self) -> dict[str, Any] | None:
        """The open pass's running sums (a segment's end), else ``None``."""
        if self._open is None:
            return None
        run, step = self._open
        return carried(step, run.tally, run.metrics, run.watch, self.design.stepper)

    def _carry_on(self, run: _TrainRun, first: int) -> None:
        """Have ``run``, a pass started at step ``first`` after a recovery, go on from the
        snapshot's running sums."""
        sums, self.carried = self.carried, None
        if sums is None:
            raise AssertionError(f"a segment from step {first} without the pass before it")
        carry_on(sums, first, run.tally, run.metrics, run.watch, self._code, self.design.stepper)

    def _start_pass(
        self,
        feed: BatchFeed,
        epoch: int,
        pass_index: int,
        lr_factor: float,
        progress: Progress | None,
    ) -> _TrainRun:
        """A training pass's start: the learning rate, train mode and zero gradients, the
        pass's tally, watch and metrics, its step's batches and the step itself."""
        design, options = self.design, self.design.options
        stepper = design.stepper
        if stepper is not None:
            stepper.set_lr_factor(lr_factor)
            stepper.start_pass()
        self.model.module.train()
        design.flat.zero_gradients()
        window = options.steps_per_epoch
        total = feed.total
        if window is not None:
            total = window * options.accumulate_gradient_over_n_batches
        tally = Tally(
            rank=self.rank, epoch=epoch, read_back=self._read_back, nranks=self.clique.nranks
        )
        watch = self._telemetry.started(
            feed, tally, progress, epoch=epoch, pass_index=pass_index, total=total
        )
        metrics = self._code.start(feed, "train", epoch)
        batches = self._step_batches(feed, epoch, watch)
        planned = window if window is not None else self._planned_steps(batches.counts)
        step = self._step_function(batches, epoch, tally, watch, lr_factor, planned)
        return _TrainRun(
            feed=feed, epoch=epoch, tally=tally, metrics=metrics, watch=watch, step=step
        )

    def _step_batches(self, feed: BatchFeed, epoch: int, watch: PassWatch) -> StepBatches:
        """What the pass's steps take their batches from: ``feed``, the model code (which
        notifies ``watch`` of each batch) and every rank's batch count where known."""
        window = self.options.steps_per_epoch
        accumulate = self.options.accumulate_gradient_over_n_batches
        code, watch_batch, clock = self._code, watch.batch, watch.clock
        model_loss = code.loss

        def backward(
            batch: LoadedBatch,
            weight: float,
            before_backward: Callable[[torch.Tensor], None] | None = None,
            /,
        ) -> torch.Tensor:
            watch_batch(batch)
            code.last_batch = batch
            if watch.counting_flops:
                loss = watch.counted(
                    lambda: model_loss(
                        batch, "train", epoch, weight=weight, before=before_backward
                    ),
                    batch.examples,
                )
            else:
                loss = model_loss(batch, "train", epoch, weight=weight, before=before_backward)
            clock.mark(FORWARD_BACKWARD)
            return loss

        def pad() -> None:
            code.padding_pass(epoch, phase="train", feed=feed)

        if window is not None:  # every rank's stream has the window's batches
            counts: list[int] | None = [window * accumulate] * self.clique.nranks
        else:
            counts = self._peers.batch_counts(feed.total)
        return StepBatches(
            feed=feed, backward=backward, accumulate=accumulate, pad=pad, counts=counts
        )

    def _step_function(
        self,
        batches: StepBatches,
        epoch: int,
        tally: Tally,
        watch: PassWatch,
        lr_factor: float,
        planned: int | None,
    ) -> Callable[[int], bool]:
        """The pass's step, a function of the step's index (from 0) that returns whether
        another step follows: it raises :class:`PassStopped` once the feed is stopped, sets
        the step's learning rate (``learning_rate_per_step``), runs the design's step and
        counts what came back of it. ``planned``: the pass's step count where known."""
        design, clique, feed = self.design, self.clique, batches.feed
        stepper = design.stepper
        per_step = self.options.learning_rate_per_step
        rate_of = getattr(per_step, "rate", None)  # schedules.rate: the learning rates
        factor_of = None if rate_of is not None else getattr(per_step, "factor", None)
        window = self.options.steps_per_epoch
        start_step = watch.clock.start_step
        last = None if planned is None else planned - 1

        def step_once(step: int) -> bool:
            if feed.stopped:
                raise PassStopped
            if stepper is not None and window is not None:  # a step schedule needs windows
                if rate_of is not None:
                    stepper.set_lr_rates(lr_factor, rate_of(epoch * window + step))
                elif factor_of is not None:
                    stepper.set_lr_factor(lr_factor * factor_of(epoch * window + step))
            start_step()
            clique.at_step(epoch, "train", step)
            more = design.train_step(batches, epoch=epoch, step=step, tally=tally, planned=planned)
            if last is not None:
                more = step < last
            if stepper is not None:
                tally.poll()
                if not more:
                    tally.drain()
            return more

        return step_once

    def _finish_pass(self, run: _TrainRun, *, steps: int) -> PassResult:
        """A training pass's end after its ``steps`` steps: the last step's exchange waited
        for, the pass's sums over the clique in one reduce (the metrics and the telemetry's
        rows), the watch's report, and the pass's result."""
        watch, tally, epoch = run.watch, run.tally, run.epoch
        watch.settle()  # the design's settle: waits for what the last step sent
        values, rows = self._peers.pass_sums(run.metrics, watch.row())
        watch.finished(rows, values)
        if self.options.steps_per_epoch is not None:
            self.position = run.feed.position
            if self.position is None:
                raise AssertionError("a window ended on a batch without its stream position")
        if self.design.stepper is None:
            return PassResult(loss=math.nan, examples=0, steps=steps)
        if tally.examples == 0 and tally.skipped == 0:
            raise TrainingError(
                f"epoch {epoch}: the training pass saw no examples on any rank"
                + ("" if self.model.mean_over == "examples" else " (or no tokens)")
                + "; check train_batches",
                rank=self.rank,
                phase="train",
            )
        return PassResult(
            loss=tally.loss,  # weighted by examples or tokens: what the loss is a mean over
            examples=watch.reported_examples(tally.examples, rows),
            steps=steps,
            skipped_steps=tally.skipped,
            metrics=values,
        )

    def _planned_steps(self, counts: list[int] | None) -> int | None:
        """The pass's step count when every rank's batch count is known, else ``None`` (then
        each step carries a flag saying whether any rank has more batches)."""
        if counts is None:
            return None
        accumulate = self.options.accumulate_gradient_over_n_batches
        return max(1, *(-(-n // accumulate) for n in counts))

    # -- the validation pass -----------------------------------------------------------------

    def validation_pass(self, feed: BatchFeed, *, epoch: int) -> PassResult:
        """One validation pass in eval mode without gradients; one reduce at the end. The
        root's result covers the whole clique; a follower's its own examples. The loss is the
        mean of the batches' losses weighted by their weight (examples or tokens: what the
        loss is a mean over), over every rank."""
        self._check_thread()
        self.model.module.eval()
        code = self._code
        metrics = code.start(feed, "valid", epoch)
        loss_sum: torch.Tensor | None = None
        examples = weight = 0
        lockstep = self._peers.lockstep
        # In lockstep every rank runs a forward while any rank has a batch: as many as the
        # longest source when every length is known, else agreed before each forward.
        counts = self._peers.batch_counts(feed.total) if lockstep else None
        forwards = None if counts is None else max(counts)
        index = 0
        while True:
            self.clique.at_step(epoch, "valid", feed.batches_read - code.first_batch)
            batch = feed.next()
            if forwards is not None:
                if index == forwards:
                    break
                index += 1
            elif lockstep and not self._peers.anyone([batch is not None])[0]:
                break
            if not lockstep and batch is None:
                break
            if feed.stopped:
                raise PassStopped
            if batch is None or batch.weight == 0:
                if lockstep:
                    code.padding_pass(epoch, phase="valid", feed=feed)
                continue
            code.last_batch = batch
            loss = code.weighted_loss(batch, "valid", epoch, weight=None)
            loss_sum = loss if loss_sum is None else loss_sum + loss
            examples += batch.examples
            weight += batch.weight
        return self._validation_result(epoch, metrics, loss_sum, weight, examples)

    def _validation_result(
        self,
        epoch: int,
        metrics: MetricTally | None,
        loss_sum: torch.Tensor | None,
        weight: int,
        examples: int,
    ) -> PassResult:
        """The validation pass's sums over the clique on the root, in one reduce: the weight,
        the weighted loss sum, the examples and the metrics."""
        meta = host_to_device([weight, 0.0, examples], torch.float64, self.device)
        if metrics is not None:  # behind the weight, the loss and the examples: one reduce
            meta = torch.cat([meta, metrics.local()])
        if loss_sum is not None:
            meta[1] = loss_sum
        self._peers.sum_to_root(meta)
        if not self.is_root:
            return PassResult(loss=math.nan, examples=examples, steps=0)
        total_weight, total_loss, total_examples = meta[:3].tolist()
        if total_weight == 0:
            raise TrainingError(
                f"epoch {epoch}: the validation pass saw no examples on any rank"
                + ("" if self.model.mean_over == "examples" else " (or no tokens)")
                + "; check validation_batches",
                rank=self.rank,
                phase="valid",
            )
        values = {} if metrics is None else metrics.values(meta[3:])
        return PassResult(
            loss=total_loss / total_weight,
            examples=int(total_examples),
            steps=0,
            metrics=values,
        )
