"""The step kernel: a rank's passes as plain loops on its compute thread.

Every method of :class:`StepKernel` runs on the rank's compute thread (see ``_compute``), the
thread that launches the kernels: take the next step's batches from the feed, forward,
backward, exchange, step, publish progress, repeat. The event loop only starts a pass and
awaits its end (see ``_pass``), so it never touches the device.

The kernel holds the pass loop and the model code; each training step is the rank's design's
(see ``_designs``: a rank alone, stepping on the root, on every rank, or sharded), which takes
the batches, runs the kernel's model code on them, exchanges the gradients and steps. Whatever
the design, the update equals one process stepping on the concatenation of every rank's
batches of the step. The pass ends when no rank has batches left.

The model's metrics (see ``_metrics``) are updated from each batch's output on the device and
summed over the clique once a pass: behind the validation pass's examples and loss in its one
reduce, and at the end of a training pass in one reduce of their own (not behind each step's
gradients, whose tail is summed in the gradients' dtype).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import attrs
import torch

from .._checkpoint import FileRecord, ShardedState, capture_rng_states
from .._errors import LampdistError, TrainingError
from .._flops import count_flops, peak_flops
from .._model import SupervisedModel
from .._options import StepOptions
from .._source import PassKind
from .._state import PassEvent, TrainingState
from .._wakeup import on_event_loop_thread
from ..clique import Clique
from ._blame import describe_batch
from ._clock import DATA, EXCHANGE, FORWARD_BACKWARD, IDLE, NO_CLOCK, start_clock
from ._designs import Design, StepBatches
from ._device import host_to_device
from ._feed import BatchFeed, LoadedBatch, PassStopped
from ._metrics import MetricTally
from ._objects import gather_objects
from ._progress import Progress, ProgressFields
from ._result import CheckpointParts, PassResult
from ._stream import StreamPosition
from ._tally import ReadBack, Tally
from ._telemetry import ROW, PassTelemetry, Stragglers, splits, tokens

__all__ = ["StepKernel"]

logger = logging.getLogger(__name__)


@attrs.define(eq=False)
class StepKernel:
    """One rank's passes on its compute thread, stepping by ``design``, which it connects to
    ``clique``.

    Every method runs on the compute thread, which owns every field: the event loop reads
    none of them while a pass runs.
    """

    rank: int
    clique: Clique
    model: SupervisedModel
    design: Design
    _read_back: ReadBack | None = attrs.field(default=None, init=False)
    _stragglers: Stragglers = attrs.field(init=False)
    """The root's account of stragglers over the passes."""
    position: StreamPosition | None = attrs.field(default=None, init=False)
    """With ``steps_per_epoch``: the rank's place in its training stream after the last
    window (what a checkpoint stores)."""
    _metrics: MetricTally | None = attrs.field(default=None, init=False)
    """The pass's metrics, when the model has some."""
    _last_batch: LoadedBatch | None = attrs.field(default=None, init=False)
    """The last batch this rank ran forward (what a padding pass reruns)."""
    _first_batch: int = attrs.field(default=0, init=False)
    """The feed's batches taken before the pass (a batch's index in the pass is its number in
    the feed less these)."""
    _timing_events: list[Any] = attrs.field(factory=list, init=False)
    """CUDA timing events free for the step split, reused from pass to pass."""
    _flops_per_example: float | None = attrs.field(default=None, init=False)
    """The model's FLOPs per example (given, or counted on the root's first batch)."""
    _count_flops: bool = attrs.field(default=False, init=False)
    """Whether the root's next training batch is to be counted."""
    _peak_flops: float | None = attrs.field(default=None, init=False)
    """The clique's peak FLOP/s (the root's; ``None`` where unknown)."""

    def __attrs_post_init__(self) -> None:
        self.design.connect(self.clique)
        self._stragglers = Stragglers(every_rank_steps=self.design.followers_step)
        given = self.model.flops_per_example
        if self.is_root:
            self._count_flops = given == "count"
            self._flops_per_example = None if given in (None, "count") else float(given)
            peak = peak_flops(self.device, self.design.options.autocast_dtype)
            self._peak_flops = None if peak is None else peak * self.clique.nranks

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
        every rank's place in its training stream and RNG states. Every rank calls it,
        between passes."""
        self._check_thread()
        optimizer_state = self.design.checkpoint_optimizer_state()
        records = self.design.checkpoint_shards(shards)
        rng = capture_rng_states()
        mine = {
            "position": None if self.position is None else self.position.to_plain(),
            "rng_tensors": rng.tensors(),
            "rng_json": rng.to_json(),
        }
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
    ) -> PassResult:
        """One training pass over ``feed``; the result covers the whole clique where this
        rank steps. ``progress`` (the root's) gets an event after every step. With
        ``steps_per_epoch`` the pass is that many steps over the rank's training stream, and
        ``learning_rate_per_step`` scales each step's learning rate. Raises
        :class:`PassStopped` between steps once the feed is stopped."""
        self._check_thread()
        design, options, clique = self.design, self.design.options, self.clique
        stepper = design.stepper
        if stepper is not None:
            stepper.set_lr_factor(lr_factor)
            stepper.start_pass()
        self.model.module.train()
        design.flat.zero_gradients()
        started = time.perf_counter()
        # A training stream's feed lives across passes: count this pass's batches only.
        first_batch = self._first_batch = feed.batches_read
        window = options.steps_per_epoch
        accumulate = options.accumulate_gradient_over_n_batches
        total = feed.total
        if window is not None:
            total = window * accumulate
        if self._read_back is None and self.device.type == "cuda":
            self._read_back = ReadBack(self.device)
        tally = Tally(
            rank=self.rank, epoch=epoch, read_back=self._read_back, nranks=self.clique.nranks
        )
        per_step = options.learning_rate_per_step
        metrics = self._metrics = MetricTally.start(
            self.model, self.device, rank=self.rank, phase="train", epoch=epoch
        )
        clock = start_clock(self.device, self._timing_events) if options.step_split else NO_CLOCK
        telemetry = PassTelemetry(clock)

        def backward(
            batch: LoadedBatch,
            weight: float,
            before_backward: Callable[[torch.Tensor], None] | None = None,
            /,
        ) -> torch.Tensor:
            clock.mark(DATA)
            telemetry.count(batch)
            self._last_batch = batch
            if self._count_flops:
                loss = self._counted_loss(batch, epoch, weight, before_backward)
            else:
                loss = self._model_loss(
                    batch, "train", epoch, weight=weight, before=before_backward
                )
            clock.mark(FORWARD_BACKWARD)
            return loss

        def pad() -> None:
            self._padding_pass(epoch, phase="train")

        counts = None if window is not None else self._batch_counts(feed)
        if window is not None:  # every rank's stream has the window's batches
            counts = [window * accumulate] * self.clique.nranks
        batches = StepBatches(
            feed=feed, backward=backward, accumulate=accumulate, pad=pad, counts=counts
        )
        last: PassEvent | None = None
        pass_fields = ProgressFields(
            epoch, "train", pass_index, total, self._flops_per_example, self._peak_flops
        )
        design.clock = clock
        with design.attached():
            planned = window if window is not None else self._planned_steps(counts)
            step = 0
            more = True
            while more:
                if feed.stopped:
                    raise PassStopped
                if per_step is not None and stepper is not None:
                    assert window is not None  # StepOptions checks it
                    stepper.set_lr_factor(lr_factor * per_step.factor(epoch * window + step))
                clock.start_step()
                clique.at_step(epoch, "train", step)
                more = design.train_step(
                    batches, epoch=epoch, step=step, tally=tally, planned=planned
                )
                step += 1
                if planned is not None:
                    more = step < planned
                if stepper is not None:
                    tally.poll()
                    if not more:
                        tally.drain()
                if progress is not None:
                    seconds = time.perf_counter() - started
                    batches_read = feed.batches_read - first_batch
                    if pass_fields.flops_per_example != self._flops_per_example:
                        pass_fields = pass_fields._replace(
                            flops_per_example=self._flops_per_example
                        )
                    if more:
                        # The event itself is built on the loop, for the events it takes.
                        progress.publish_step(
                            pass_fields,
                            tally.steps_read,
                            batches_read,
                            tally.examples,
                            tally.loss,
                            seconds,
                            telemetry.estimate_tokens(tally.examples),
                        )
                    else:
                        # with the pass's sums over the clique, once they are summed
                        last = pass_fields.event(
                            tally.steps_read,
                            batches_read,
                            tally.examples,
                            tally.loss,
                            seconds,
                            done=True,
                        )
        clock.mark(IDLE)
        design.settle()
        clock.mark(EXCHANGE)
        design.clock = NO_CLOCK
        values, rows = self._pass_sums(metrics, telemetry)
        norms = None if stepper is None else stepper.take_norms()
        if self.is_root:
            split = splits(rows, measured=options.step_split)
            message = self._stragglers.judge(split)
            if message is not None:
                logger.warning("epoch %d: %s", epoch, message, extra={"rank": self.rank})
            if progress is not None and last is not None:
                progress.publish(
                    attrs.evolve(
                        last,
                        metrics=values,
                        tokens=tokens(rows),
                        grad_norm=None if norms is None else norms[0],
                        grad_norm_max=None if norms is None else norms[1],
                        step_split=split,
                    )
                )
        if window is not None:
            self.position = feed.position
            if self.position is None:
                raise AssertionError("a window ended on a batch without its stream position")
        if stepper is None:
            return PassResult(loss=math.nan, examples=0, steps=step)
        if tally.examples == 0 and tally.skipped == 0:
            raise TrainingError(
                f"epoch {epoch}: the training pass saw no examples on any rank; "
                "check train_batches",
                rank=self.rank,
                phase="train",
            )
        return PassResult(
            loss=tally.loss,
            examples=tally.examples,
            steps=step,
            skipped_steps=tally.skipped,
            metrics=values,
        )

    def _pass_sums(
        self, metrics: MetricTally | None, telemetry: PassTelemetry
    ) -> tuple[dict[str, float | tuple[float, ...]], list[list[float]]]:
        """A training pass's metrics over the clique and every rank's telemetry row (see
        ``_telemetry``), on the root, in one reduce (empty elsewhere)."""
        width = len(ROW)
        row = telemetry.row()
        if self.alone:
            values = {} if metrics is None else metrics.values(metrics.local())
            return values, [row]
        nranks = self.clique.nranks
        table = [0.0] * (nranks * width)
        table[self.rank * width : (self.rank + 1) * width] = row
        summed = host_to_device(table, torch.float64, self.device)
        if metrics is not None:
            summed = torch.cat([metrics.local(), summed])
        self.clique.start_reduce([summed], root=0).wait_blocking(None)
        if not self.is_root:
            return {}, []
        head = summed.numel() - nranks * width
        values = {} if metrics is None else metrics.values(summed[:head])
        flat = summed[head:].tolist()
        return values, [flat[r * width : (r + 1) * width] for r in range(nranks)]

    def _counted_loss(
        self,
        batch: LoadedBatch,
        epoch: int,
        weight: float,
        before: Callable[[torch.Tensor], None] | None,
    ) -> torch.Tensor:
        """:meth:`_model_loss` of the root's first training batch, its FLOPs counted (the
        model's FLOPs per example, once a run: ``flops_per_example="count"``)."""
        self._count_flops = False
        losses: list[torch.Tensor] = []

        def run() -> None:
            losses.append(self._model_loss(batch, "train", epoch, weight=weight, before=before))

        flops = count_flops(run)
        if flops > 0 and batch.examples > 0:
            self._flops_per_example = flops / batch.examples
        else:
            logger.warning(
                "flops_per_example='count' counted no FLOPs in the first batch's forward and "
                "backward (no matrix product); no MFU is reported",
                extra={"rank": self.rank},
            )
        return losses[0]

    def _batch_counts(self, feed: BatchFeed) -> list[int] | None:
        """Every rank's batch count of the pass when every rank's source has a length, else
        ``None`` (one all-gather)."""
        local = -1 if feed.total is None else feed.total
        if self.alone:
            lengths = [local]
        else:
            mine = host_to_device([local], torch.int64, self.device)
            gathered = torch.zeros(self.clique.nranks, dtype=torch.int64, device=self.device)
            self.clique.start_all_gather(gathered, mine).wait_blocking(None)
            lengths = [int(n) for n in gathered.tolist()]
        return None if min(lengths) < 0 else lengths

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
        root's result covers the whole clique; a follower's its own examples."""
        self._check_thread()
        self.model.module.eval()
        self._first_batch = feed.batches_read
        metrics = self._metrics = MetricTally.start(
            self.model, self.device, rank=self.rank, phase="valid", epoch=epoch
        )
        loss_sum: torch.Tensor | None = None
        examples = 0
        lockstep = self.design.lockstep and not self.alone
        # In lockstep every rank runs a forward while any rank has a batch: as many as the
        # longest source when every length is known, else agreed before each forward.
        counts = self._batch_counts(feed) if lockstep else None
        forwards = None if counts is None else max(counts)
        index = 0
        while True:
            self.clique.at_step(epoch, "valid", feed.batches_read - self._first_batch)
            batch = feed.next()
            if forwards is not None:
                if index == forwards:
                    break
                index += 1
            elif lockstep and not self._anyone([batch is not None])[0]:
                break
            if not lockstep and batch is None:
                break
            if feed.stopped:
                raise PassStopped
            if batch is None or batch.examples == 0:
                if lockstep:
                    self._padding_pass(epoch, phase="valid")
                continue
            self._last_batch = batch
            loss = self._weighted_loss(batch, "valid", epoch, weight=None)
            loss_sum = loss if loss_sum is None else loss_sum + loss
            examples += batch.examples
        meta = host_to_device([examples, 0.0], torch.float64, self.device)
        if metrics is not None:  # behind the examples and the loss, in the same reduce
            meta = torch.cat([meta, metrics.local()])
        if loss_sum is not None:
            meta[1] = loss_sum
        if not self.alone:
            self.clique.start_reduce([meta], root=0).wait_blocking(None)
        if not self.is_root:
            return PassResult(loss=math.nan, examples=examples, steps=0)
        total_examples, total_loss = meta[:2].tolist()
        if total_examples == 0:
            raise TrainingError(
                f"epoch {epoch}: the validation pass saw no examples on any rank; "
                "check validation_batches",
                rank=self.rank,
                phase="valid",
            )
        values = {} if metrics is None else metrics.values(meta[2:])
        return PassResult(
            loss=total_loss / total_examples,
            examples=int(total_examples),
            steps=0,
            metrics=values,
        )

    # -- model code ---------------------------------------------------------------------------

    def _model_loss(
        self,
        batch: LoadedBatch,
        phase: PassKind,
        epoch: int,
        *,
        weight: float | None,
        before: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """The batch's mean loss, detached. With ``weight``, first the backward of the mean
        loss times ``weight`` (times the fp16 loss scale), ``before`` called with the loss
        ahead of it; without, evaluated without gradients. The pass's metrics take the same
        forward's output. User errors come back naming the rank, the batch's index in the
        pass and its shapes."""
        metrics = self._metrics
        try:
            if weight is None:
                with torch.no_grad(), self._autocast():
                    loss, output = self._forward(batch)
            else:
                if self.design.options.autocast_dtype is None:
                    loss, output = self._forward(batch)
                else:
                    with self._autocast():
                        loss, output = self._forward(batch)
                factor = weight * self.design.loss_scale.factor
                weighted = loss if factor == 1.0 else loss * factor
                if before is not None:
                    before(loss.detach())
                weighted.backward()  # type: ignore[no-untyped-call]  # torch's backward is untyped
                flat = self.design.flat
                if flat.flat_gradients:
                    flat.ensure_gradient_views()
            if metrics is not None:
                with torch.no_grad():
                    metrics.update(output, batch.target)
        except LampdistError:
            raise
        except Exception as exc:
            if self.design.lockstep and not self.alone:
                # The design's collectives run inside the model: a peer that left makes them
                # raise here, and the clique knows which peer.
                failure = self.clique.explain(exc, phase)
                if failure is not None:
                    raise failure from exc
            index = batch.number - self._first_batch
            raise TrainingError(
                f"epoch {epoch}, batch {index}: the model raised {type(exc).__name__}: {exc} "
                f"({describe_batch(batch.inputs, batch.target)})",
                rank=self.rank,
                phase=phase,
            ) from exc
        return loss.detach()

    def _padding_pass(self, epoch: int, *, phase: PassKind) -> None:
        """A forward of the rank's last batch in eval mode with no metric (training: and its
        backward of weight 0), where this rank has no batch and a design that shards the model
        needs the collectives inside the forward and backward to meet the other ranks'."""
        batch = self._last_batch
        if batch is None:
            raise TrainingError(
                f"epoch {epoch}: this rank has no batch yet and the other ranks run a forward: "
                f"under step_on={self.options.step_on!r} every rank runs each forward (a rank "
                "without a batch reruns its last one with weight 0); give every rank a "
                "non-empty first batch",
                rank=self.rank,
                phase=phase,
            )
        module = self.model.module
        training = module.training
        module.eval()
        metrics, self._metrics = self._metrics, None
        try:
            self._model_loss(batch, phase, epoch, weight=0.0 if phase == "train" else None)
        finally:
            self._metrics = metrics
            module.train(training)

    def _anyone(self, flags: list[bool]) -> list[bool]:
        """For each flag, whether any rank's is set (one small all-reduce)."""
        values = host_to_device([float(flag) for flag in flags], torch.float64, self.device)
        self.clique.start_all_reduce([values]).wait_blocking(None)
        return [value > 0 for value in values.tolist()]

    def _forward(self, batch: LoadedBatch) -> tuple[torch.Tensor, Any]:
        """The batch's mean loss, and its output when the pass has metrics (else ``None``)."""
        if self._metrics is None:
            return self.model.forward_loss(batch.inputs, batch.target), None
        return self.model.forward_loss_and_output(batch.inputs, batch.target)

    def _weighted_loss(
        self, batch: LoadedBatch, phase: PassKind, epoch: int, *, weight: float | None
    ) -> torch.Tensor:
        """:meth:`_model_loss` times the batch's examples, in float64 on the device."""
        loss = self._model_loss(batch, phase, epoch, weight=weight)
        return loss.to(torch.float64) * batch.examples

    def _autocast(self) -> AbstractContextManager[object]:
        dtype = self.options.autocast_dtype
        if dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)
