"""What the designs of two or more ranks share: the step's sums, its exchange and its update.

A step of an exchanging design, on every rank: forward and backward over up to ``accumulate``
batches with each batch's mean loss weighted by its weight (its examples, or its tokens for a
loss that is a mean over tokens: ``LoadedBatch.weight``; "examples" below means that count), so
that the flat gradient buffers hold sums (with fp16 loss scaling, by its share of the nominal
step: see ``LossScale.nominal``; the last backward starts the gradient buckets as they fill,
with ``bucket_cap_mb``: see ``_buckets``); the step's meta values (examples, loss sum, whether
the rank has more batches: see ``_values``) written behind the gradients or beside them; the
exchange that the design starts (:meth:`ExchangingDesign.start_step_exchanges`); then, where
the rank steps, the update (:meth:`ExchangingDesign.step_here`: divide by the clique's
examples, clip, step) and what the design sends after it (:meth:`ExchangingDesign.publish`).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

import attrs
import torch

from ...clique import PendingCollective
from .._buckets import GradientBuckets
from .._clock import DATA, EXCHANGE, OPTIMIZER
from .._objects import broadcast_object
from .._stepper import Combine
from .._tally import Tally
from .._values import EXAMPLES, read_meta, write_meta
from ._base import Design, StepBatches

__all__ = ["ExchangingDesign"]


@attrs.define(eq=False)
class ExchangingDesign(Design):
    """A design for a clique of two or more ranks (see the module docstring).

    Subclasses implement :meth:`start_exchange` (the collective of gradients) and
    :meth:`publish` (what a stepping rank sends after its step), and may override
    :meth:`start_step_exchanges` (the step's collectives once backward is done),
    :meth:`before_forward`, :attr:`meta_behind_gradients`, :attr:`combine` and :meth:`update`.
    """

    _buckets: GradientBuckets | None = attrs.field(default=None, init=False)
    _sent: list[PendingCollective] = attrs.field(factory=list, init=False)
    """Collectives started by the last step that the next one waits for at the latest."""

    whole_buffer_buckets = False
    """Whether a gradient bucket is a whole flat buffer (the layout cut them to size)."""

    # -- what differs between the exchanging designs ----------------------------------------

    @abc.abstractmethod
    def start_exchange(self, tensors: Sequence[torch.Tensor]) -> PendingCollective:
        """Start combining ``tensors`` (gradients, a bucket's or all, with or without the meta
        values behind them) over the clique, in place."""

    def start_step_exchanges(self, meta: torch.Tensor | None) -> list[PendingCollective]:
        """Start the step's exchanges once backward is done: the buckets not started yet (see
        :meth:`GradientBuckets.start_remaining`) or the whole gradients, and the meta values
        (``meta`` when they travel on their own, else behind the gradients), all through
        :meth:`start_exchange`."""
        own = [] if meta is None else [meta]
        if self._buckets is not None:
            exchanges = self._buckets.start_remaining()
        else:
            own = [*self.flat.gradient_storage, *own]
            exchanges = []
        exchanges.append(self.start_exchange(own))
        return exchanges

    @abc.abstractmethod
    def publish(
        self, more: bool, non_finite: float | None, *, own_loss: torch.Tensor, epoch: int, step: int
    ) -> bool:
        """After this rank's step: send what the other ranks need (parameters, buffers) and
        settle a non-finite summed loss (``non_finite``) with them. Returns ``more``, or what
        the followers learn of it."""

    def before_forward(self) -> None:
        """What a step waits for before its first forward (nothing by default)."""

    @property
    def meta_behind_gradients(self) -> bool:
        """Whether the meta values ride behind the gradients (one exchange) rather than on
        their own: not when bucketing, whose exchanges start before the values are known."""
        return self._buckets is None

    @property
    def combine(self) -> Combine | None:
        """How the stepper sums a scalar over the clique (its norm and overflow check over
        slices); ``None`` where each stepping rank holds whole gradients."""
        return None

    def names_every_rank(self) -> bool:
        """On the CPU every stepping rank reads each step's summed values at once; on CUDA
        only the skip policy and fp16 loss scaling make every rank read them at once."""
        if self.device.type != "cuda":
            return True
        return self.options.non_finite_loss == "skip" or self.loss_scale.enabled

    # -- the step ---------------------------------------------------------------------------

    def attached(self) -> AbstractContextManager[object]:
        """The gradient buckets' hooks for one pass (none without ``bucket_cap_mb``)."""
        cap = self.options.bucket_cap_bytes
        if cap is None:
            return nullcontext()
        if self._buckets is None:
            self._buckets = GradientBuckets.create(
                self.rank,
                self.flat,
                self.start_exchange,
                cap_bytes=cap,
                whole_buffers=self.whole_buffer_buckets,
            )
        return self._buckets.attached()

    def train_step(
        self, batches: StepBatches, *, epoch: int, step: int, tally: Tally, planned: int | None
    ) -> bool:
        """Take batches, forward and backward each (the last starts the buckets as it goes),
        exchange, then :meth:`update`."""
        self.before_forward()
        self.clock.mark(EXCHANGE)
        loss_sum: torch.Tensor | None = None
        examples = 0
        feed, accumulate = batches.feed, batches.accumulate
        for index in range(accumulate):
            batch = feed.next()
            if batch is None:
                break
            if batch.weight == 0:
                continue
            if index == accumulate - 1 and self._buckets is not None:
                self._buckets.arm()  # the step's last backward: start buckets as they fill
            weight = self.loss_scale.weight(batch.weight)  # fp16: a share of the nominal step
            loss = batches.backward(batch, weight).to(torch.float64) * batch.weight
            loss_sum = loss if loss_sum is None else loss_sum + loss
            examples += batch.weight  # the step's weight: examples or tokens
        more = feed.has_next()  # after the backward: the next batch loaded meanwhile
        self.clock.mark(DATA)
        if loss_sum is None:
            loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        meta = write_meta(self.flat, examples, loss_sum, more, tail=self.meta_behind_gradients)
        exchanges = self.start_step_exchanges(meta)
        self.settle()  # the last step's parameters, at the latest
        for exchange in exchanges:
            exchange.wait_blocking(None)
        self.clock.mark(EXCHANGE)
        learn_more = planned is None and not more
        return self.update(
            meta,
            own_loss=loss_sum,
            examples=examples,
            learn_more=learn_more,
            epoch=epoch,
            step=step,
            tally=tally,
        )

    def update(
        self,
        meta: torch.Tensor | None,
        *,
        own_loss: torch.Tensor,
        examples: int,
        learn_more: bool,
        epoch: int,
        step: int,
        tally: Tally,
    ) -> bool:
        """After the exchange: :meth:`step_here`, then :meth:`publish`."""
        more, non_finite = self.step_here(
            meta,
            own_loss=own_loss,
            examples=examples,
            learn_more=learn_more,
            epoch=epoch,
            step=step,
            tally=tally,
        )
        self.clock.mark(OPTIMIZER)
        more = self.publish(more, non_finite, own_loss=own_loss, epoch=epoch, step=step)
        self.clock.mark(EXCHANGE)
        return more

    def step_here(
        self,
        meta: torch.Tensor | None,
        *,
        own_loss: torch.Tensor,
        examples: int,
        learn_more: bool,
        epoch: int,
        step: int,
        tally: Tally,
    ) -> tuple[bool, float | None]:
        """Step this rank's optimizer on the exchanged sums; return whether any rank has more
        batches and the summed loss when it was not finite (the step was skipped).

        ``meta`` is the step's meta tensor when it travelled on its own, ``None`` when it rode
        behind the gradients; ``own_loss`` is this rank's loss sum of the step, ``examples``
        its own examples, and ``learn_more`` says that this rank must learn whether any rank
        has more batches (no plan, and none of its own left: with a batch left it knows that
        the clique has one).
        On CUDA the rank reads the summed values on the host before it steps only when it
        must: ``learn_more``, the skip policy, fp16 loss scaling, or no examples of its own
        (so that it cannot know the clique had some). Otherwise it steps on the device and the
        tally reads the values back later. On the CPU, where reading waits for nothing, it
        reads them at once.
        """
        stepper = self.stepper
        assert stepper is not None
        must_read = learn_more or stepper.needs_host_values or examples == 0
        values = read_meta(self.flat, meta)  # before the step zeroes the gradients' tail
        combine = self.combine
        non_finite: float | None = None
        if must_read or self.device.type != "cuda":
            total, loss_sum, flag = values.tolist()
            more = bool(flag > 0) if must_read else True
            if total > 0 and not math.isfinite(loss_sum):
                stepper.skip()
                tally.record(total, loss_sum, counted=False)
                non_finite = loss_sum
            elif must_read:
                counted = stepper.step(total, epoch=epoch, step=step, combine=combine)
                tally.record(total, loss_sum, counted=counted)
            else:
                stepper.step_on_device(values[EXAMPLES], combine=combine)
                tally.record(total, loss_sum, counted=True)
        else:
            stepper.step_on_device(values[EXAMPLES], combine=combine)
            tally.submit(step, values, own=own_loss)
            more = True
        return more, non_finite

    def settle(self) -> None:
        """Wait for the collectives the last step left running (their errors surface here)."""
        sent, self._sent = self._sent, []
        for pending in sent:
            pending.wait_blocking(None)

    def broadcast_module_buffers(self) -> None:
        """Give every rank the root's module buffers (a forward in train mode may update
        them), where every rank steps its own parameters."""
        if self.flat.module_buffers:
            self.clique.start_broadcast(self.flat.module_buffers).wait_blocking(None)

    def share_optimizer_state(
        self, state: dict[str, object] | None, location: torch.device | str
    ) -> None:
        """Broadcast the root's ``state`` (a whole optimizer state dict, or ``None``) to the
        followers, into ``location``, where each loads it into its stepper."""
        stepper = self.stepper
        assert stepper is not None
        state = broadcast_object(self.clique, state, rank=self.rank, map_location=location)
        if state is not None and self.rank != 0:
            stepper.load_state_dict(state)
            stepper.resumed_state = None
