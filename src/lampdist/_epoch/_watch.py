"""A rank's watch over its training passes: the step split, tokens, FLOPs and progress.

The rank's :class:`TrainTelemetry` keeps what lasts from pass to pass (the root's account of
stragglers, its FLOPs per example and peak FLOP/s, the CUDA timing events) and starts one
:class:`PassWatch` a training pass (:meth:`TrainTelemetry.started`), which the step kernel
notifies and which measures the pass: the step split by the clock it lends the design for the
pass (see ``_clock``), each batch's tokens (:meth:`PassWatch.batch`), the FLOPs of the root's
first batch of a run with ``flops_per_example="count"`` (:meth:`PassWatch.counted`), a progress
event after each step (:meth:`PassWatch.stepped`), and, once the pass's sums are in (see
``_telemetry``), the gradient norms, the straggler's warning and the root's last event
(:meth:`PassWatch.finished`). Everything here runs on the rank's compute thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch

from .._flops import count_flops, peak_flops
from .._metric import MetricValue
from .._model import BatchModel
from .._state import PassEvent
from ._clock import DATA, EXCHANGE, IDLE, NO_CLOCK, StepClock, start_clock
from ._designs import Design
from ._feed import BatchFeed, LoadedBatch
from ._progress import Progress, ProgressFields
from ._tally import Tally
from ._telemetry import Stragglers, examples, splits, tokens

__all__ = ["PassWatch", "TrainTelemetry"]

logger = logging.getLogger(__name__)


@attrs.define(eq=False)
class TrainTelemetry:
    """What a rank's telemetry keeps over its training passes (the compute thread)."""

    rank: int
    device: torch.device
    design: Design
    stragglers: Stragglers
    """The root's account of stragglers over the passes."""
    flops_per_example: float | None = None
    """The model's FLOPs per example (given, or counted on the root's first batch)."""
    count_flops: bool = False
    """Whether the root's next training batch is to be counted."""
    peak_flops: float | None = None
    """The clique's peak FLOP/s (the root's; ``None`` where unknown)."""
    timing_events: list[Any] = attrs.field(factory=list)
    """CUDA timing events free for the step split, reused from pass to pass."""
    nranks: int = 1
    by_examples: bool = True
    """Whether the model's loss is a mean over examples (then a step's weight, what the
    tally counts, is its examples; else its tokens, and the events' examples are counted
    apart: see :meth:`PassWatch.reported_examples`)."""

    @classmethod
    def create(
        cls, rank: int, design: Design, model: BatchModel, device: torch.device, nranks: int
    ) -> TrainTelemetry:
        """The telemetry of rank ``rank`` of ``nranks``, which trains ``model`` by ``design``
        on ``device``: the FLOPs are the root's."""
        telemetry = cls(rank, device, design, Stragglers(every_rank_steps=design.followers_step))
        telemetry.nranks = nranks
        telemetry.by_examples = model.mean_over == "examples"
        given = model.flops_per_example
        if rank == 0:
            telemetry.count_flops = given == "count"
            telemetry.flops_per_example = None if given in (None, "count") else float(given)
            peak = peak_flops(device, design.options.autocast_dtype)
            telemetry.peak_flops = None if peak is None else peak * nranks
        return telemetry

    def started(
        self,
        feed: BatchFeed,
        tally: Tally,
        progress: Progress | None,
        *,
        epoch: int,
        pass_index: int,
        total: int | None,
    ) -> PassWatch:
        """A training pass over ``feed`` starts (its steps counted in ``tally``; ``progress``,
        the root's, gets an event after each, of ``total`` batches): its watch, whose clock
        the design marks during the pass."""
        begun = time.perf_counter()
        options = self.design.options
        clock = (
            start_clock(self.device, self.timing_events) if options.measure_step_split else NO_CLOCK
        )
        self.design.clock = clock
        peak = self.peak_flops
        if progress is not None and progress.peak_flops is not None:  # the option wins
            peak = progress.peak_flops * self.nranks
        fields = ProgressFields(epoch, "train", pass_index, total, self.flops_per_example, peak)
        watch = PassWatch(
            telemetry=self,
            clock=clock,
            feed=feed,
            tally=tally,
            progress=progress,
            fields=fields,
            begun=begun,
            first_batch=feed.batches_read,
            counting_flops=self.count_flops,
        )
        if progress is not None and progress.every_n_steps is not None:
            tally.window, tally.on_window = progress.every_n_steps, watch.window_ended
        return watch


@attrs.define(eq=False)
class PassWatch:
    """One training pass's telemetry (see the module docstring): notified by the kernel of
    each batch, each step, the last step's exchange and the pass's sums."""

    telemetry: TrainTelemetry
    clock: StepClock
    """The pass's clock, the design's while the pass runs."""
    feed: BatchFeed
    tally: Tally
    progress: Progress | None
    fields: ProgressFields
    begun: float
    """``time.perf_counter()`` at the pass's start."""
    first_batch: int
    """The feed's batches taken before the pass (a training stream's feed lives across
    passes: the events count this pass's batches only)."""
    counting_flops: bool
    """Whether the next batch's FLOPs are to be counted (:meth:`counted`)."""
    tokens: int = 0
    untokened: int = 0
    """Batches that did not say how many tokens they hold."""
    examples: int = 0
    """The rank's own examples (the root's estimate of the clique's tokens mid-pass)."""
    weight: int = 0
    """The rank's own weight (examples or tokens: see :attr:`LoadedBatch.weight`)."""
    last: PassEvent | None = None
    """The root's last event, published with the pass's sums (:meth:`finished`)."""
    window_begun: float | None = None
    """``time.perf_counter()`` at the last window's end (:meth:`window_ended`)."""

    def batch(self, batch: LoadedBatch) -> None:
        """The model code takes ``batch``: the time since the clock's last mark was data;
        count the batch's tokens and examples."""
        self.clock.mark(DATA)
        if batch.tokens is None:
            self.untokened += 1
        else:
            self.tokens += batch.tokens
        self.examples += batch.examples
        self.weight += batch.weight

    def counted(self, loss: Callable[[], torch.Tensor], examples: int) -> torch.Tensor:
        """``loss()``, the model code on the root's first training batch of the run
        (``examples`` examples), its FLOPs counted: the model's FLOPs per example, once a
        run (``flops_per_example="count"``)."""
        telemetry = self.telemetry
        self.counting_flops = telemetry.count_flops = False
        losses: list[torch.Tensor] = []

        def run() -> None:
            losses.append(loss())

        flops = count_flops(run)
        if flops > 0 and examples > 0:
            telemetry.flops_per_example = flops / examples
            self.fields = self.fields._replace(flops_per_example=telemetry.flops_per_example)
        else:
            logger.warning(
                "flops_per_example='count' counted no FLOPs in the first batch's forward and "
                "backward (no matrix product); no MFU is reported",
                extra={"rank": telemetry.rank},
            )
        return losses[0]

    def stepped(self, more: bool) -> None:
        """A step ended (``more``: another follows): its progress event, with ``progress``.
        The last step's waits for the pass's sums (:meth:`finished`)."""
        progress = self.progress
        if progress is None:
            return
        tally = self.tally
        seconds = time.perf_counter() - self.begun
        batches_read = self.feed.batches_read - self.first_batch
        clique_examples = self.reported_examples(tally.examples)
        if more:
            # The event itself is built on the loop, for the events it takes.
            progress.publish_step(
                self.fields,
                tally.steps_read,
                batches_read,
                clique_examples,
                tally.loss,
                seconds,
                self.estimate_tokens(clique_examples),
            )
        else:
            # with the pass's sums over the clique, once they are summed
            self.last = self.fields.event(
                tally.steps_read, batches_read, clique_examples, tally.loss, seconds, done=True
            )

    def window_ended(self, step: int, weight: int, loss: float) -> None:
        """The tally counted a window's last step, ``step``: the window's event, with its
        examples (from its ``weight``, see :meth:`reported_examples`) and their mean ``loss``
        over every rank, weighted as the pass's is (``LoopOptions.log_every_n_steps``)."""
        progress = self.progress
        assert progress is not None and progress.every_n_steps is not None
        now = time.perf_counter()
        seconds = now - (self.begun if self.window_begun is None else self.window_begun)
        self.window_begun = now
        batches_read = self.feed.batches_read - self.first_batch
        examples = self.reported_examples(weight)
        event = self.fields.event(step, batches_read, examples, loss, seconds)
        progress.publish_window(attrs.evolve(event, window_steps=progress.every_n_steps))

    def reported_examples(self, weight: int, rows: list[list[float]] | None = None) -> int:
        """The clique's examples so far, from the tally's ``weight``: the weight itself when
        the loss is a mean over examples; else the sum of the ranks' ``rows`` when given (the
        pass's end, on the root), or an estimate from this rank's examples per weight."""
        if self.telemetry.by_examples:
            return weight
        if rows:
            return examples(rows)
        if self.weight == 0:
            return 0
        return round(self.examples / self.weight * weight)

    def estimate_tokens(self, clique_examples: int) -> int | None:
        """The clique's tokens so far, from this rank's tokens per example (mid-pass)."""
        if self.untokened or self.examples == 0:
            return None
        return round(self.tokens / self.examples * clique_examples)

    def settle(self) -> None:
        """The pass's last step ended: the design's :meth:`~Design.settle` (the wait for
        what the step sent, timed as the exchange), and the design's clock back."""
        clock, design = self.clock, self.telemetry.design
        clock.mark(IDLE)
        design.settle()
        clock.mark(EXCHANGE)
        design.clock = NO_CLOCK

    def row(self) -> list[float]:
        """The rank's row (:data:`~._telemetry.ROW`): waits for the clock's last events."""
        return [
            float(self.clock.steps),
            *self.clock.finish(),
            self.tokens,
            self.untokened,
            self.examples,
        ]

    def finished(self, rows: list[list[float]], values: dict[str, MetricValue]) -> None:
        """The pass's sums are in: every rank's :meth:`row` and the metrics' ``values`` (the
        root's; empty elsewhere). Takes the stepper's gradient norms; the root judges the
        stragglers by the step split and publishes the pass's last event with them all."""
        telemetry = self.telemetry
        design = telemetry.design
        stepper = design.stepper
        norms = None if stepper is None else stepper.take_norms()
        if telemetry.rank != 0:
            return
        split = splits(rows, measured=design.options.measure_step_split)
        message = telemetry.stragglers.judge(split)
        if message is not None:
            logger.warning(
                "epoch %d: %s", self.fields.epoch, message, extra={"rank": telemetry.rank}
            )
        progress, last = self.progress, self.last
        if progress is not None and last is not None:
            progress.publish(
                attrs.evolve(
                    last,
                    examples=self.reported_examples(self.tally.examples, rows),
                    metrics=values,
                    tokens=tokens(rows),
                    grad_norm=None if norms is None else norms[0],
                    grad_norm_max=None if norms is None else norms[1],
                    step_split=split,
                )
            )
