"""A rank alone in its clique: a plain loop's step, with nothing to exchange."""

from __future__ import annotations

import math

import attrs
import torch

from ..._options import StepOptions
from .._clock import DATA, OPTIMIZER
from .._feed import LoadedBatch
from .._flat import FlatParameters
from .._tally import Tally
from ._base import Design, StepBatches

__all__ = ["Solo", "step_alone"]


@attrs.define(eq=False)
class Solo(Design):
    """The design of a rank alone (``nranks=1``, whatever ``step_on`` says): no gradient
    buffers (autograd keeps the gradients as a plain loop's, set to ``None`` after each step,
    which saves a fill and a read of every gradient a step), no collective, and each batch's
    loss weighted by its share of the step's weight (examples or tokens) before backward, so
    that the gradients are the step's average as they come out of backward: no division
    pass."""

    @classmethod
    def lay_out(
        cls, module: torch.nn.Module, device: torch.device, nranks: int, options: StepOptions
    ) -> FlatParameters:
        return FlatParameters.create(module, device, gradients=False)

    def names_every_rank(self) -> bool:
        return False  # nothing to gather: the summed loss is the rank's own

    def train_step(
        self, batches: StepBatches, *, epoch: int, step: int, tally: Tally, planned: int | None
    ) -> bool:
        return step_alone(self, batches, epoch=epoch, step=step, tally=tally)


def step_alone(
    design: Design, batches: StepBatches, *, epoch: int, step: int, tally: Tally
) -> bool:
    """A plain loop's step for ``design``, a rank alone: the step's batches are taken first
    (for their weight: examples or tokens, what the loss is a mean over), then each one's
    forward and backward, its loss weighted by its share of the step's weight, so that the
    gradients come out of backward averaged (no division pass). Returns whether the source
    has more batches."""
    feed = batches.feed
    if batches.accumulate == 1:  # the common case, without the lists of the general one
        batch = feed.next()
        if batch is None or not batch.weight > 0:
            more = feed.has_next()
            tally.record(0, 0.0, counted=False)
            return more
        total = batch.weight
        loss_sum = batches.backward(batch, 1.0)  # its share of the step's weight: all
        more = feed.has_next()  # after the backward: the next batch loaded meanwhile
        design.clock.mark(DATA)
        return _update(design, epoch, step, tally, more, total, loss_sum, float(total))
    taken: list[LoadedBatch] = []
    for _ in range(batches.accumulate):
        batch = feed.next()
        if batch is None:
            break
        if batch.weight > 0:
            taken.append(batch)
    total = sum(batch.weight for batch in taken)
    # The step's loss sum: a batch's mean loss times its weight on the host, or the
    # float64 sum of several on the device.
    losses = [batches.backward(batch, batch.weight / total) for batch in taken]
    more = feed.has_next()  # after the backward: the next batch loaded meanwhile
    design.clock.mark(DATA)
    if not losses:
        tally.record(0, 0.0, counted=False)
        return more
    if len(losses) == 1:
        loss_sum, factor = losses[0], float(total)
    else:
        loss_sum, factor = losses[0].to(torch.float64) * taken[0].weight, 1.0
        for loss, batch in zip(losses[1:], taken[1:], strict=True):
            loss_sum = loss_sum + loss.to(torch.float64) * batch.weight
    return _update(design, epoch, step, tally, more, total, loss_sum, factor)


def _update(
    design: Design,
    epoch: int,
    step: int,
    tally: Tally,
    more: bool,
    examples: int,
    loss_sum: torch.Tensor,
    factor: float,
) -> bool:
    """The optimizer step on the step's averaged gradients, whose loss sum is ``loss_sum``
    times ``factor`` over ``examples`` (the step's weight); returns ``more``."""
    stepper = design.stepper
    assert stepper is not None  # a rank alone is the root
    if stepper.needs_host_values:
        value = loss_sum.item() * factor
        if not math.isfinite(value):
            stepper.skip()
            tally.record(examples, value, counted=False)
            design.non_finite.settle(epoch=epoch, step=step, summed=value, own=loss_sum * factor)
            design.clock.mark(OPTIMIZER)
            return more
        counted = stepper.step(examples, epoch=epoch, step=step, averaged=True)
        tally.record(examples, value, counted=counted)
    else:
        stepper.step_on_device(None)
        tally.submit_loss(step, examples, loss_sum, factor=factor)
    design.clock.mark(OPTIMIZER)
    return more
