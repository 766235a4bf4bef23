"""The step kernel: a rank's passes as plain loops on its compute thread.

Every method of :class:`StepKernel` runs on the rank's compute thread (see ``_compute``), the
thread that launches the kernels: take the next batch from the feed, forward, backward,
exchange, step, publish progress, repeat. The event loop only starts a pass and awaits its
end (see ``_pass``), so it never touches the device.

A training step, on every rank: forward and backward over up to ``accumulate`` batches with
each batch's mean loss weighted by its example count, so the flat gradient buffers hold sums.
With ``step_on="root"`` the gradients are reduced to the root after backward (or, with
``bucket_cap_mb``, bucket by bucket while the last backward still runs: see ``_buckets``),
with the step's ``meta`` values (examples, loss sum, whether this rank has more batches)
behind them (see ``_values``); the root divides by the clique's example count, steps and
broadcasts the parameters, the module's buffers and its root values (a ``more`` flag, the
loss scale) behind them. With ``step_on="every_rank"`` the same tensors are all-reduced and
every rank steps. With ``step_on="sharded"`` each gradient buffer is reduce-scattered (bucket
by bucket during the last backward, with ``bucket_cap_mb``), so that each rank holds the sums
of the slice it owns, and the meta values are all-reduced on their own; every rank steps its
slice (see ``_shard``) and all-gathers the parameters, which the next step's first forward
waits for (on CUDA: its stream; the host goes on). The pass ends when no rank has batches
left. Whatever the design, the update equals one process stepping on the concatenation of
every rank's batches of the step.

The model's metrics (see ``_metrics``) are updated from each batch's output on the device and
summed over the clique once a pass: behind the validation pass's examples and loss in its one
reduce, and at the end of a training pass in one reduce of their own (not behind each step's
gradients, whose tail is summed in the gradients' dtype).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import attrs
import torch

from .._checkpoint import capture_rng_states
from .._errors import LampdistError, TrainingError
from .._model import SupervisedModel
from .._options import StepOptions
from .._source import PassKind
from .._state import PassEvent
from .._wakeup import on_event_loop_thread
from ..clique import Clique, PendingCollective
from ._blame import NonFiniteSteps, describe_batch, names_every_rank
from ._buckets import GradientBuckets
from ._device import host_to_device
from ._feed import BatchFeed, LoadedBatch, PassStopped
from ._flat import FlatParameters
from ._metrics import MetricTally
from ._objects import broadcast_object, gather_objects
from ._progress import Progress
from ._result import CheckpointParts, PassResult
from ._stepper import Combine, LossScale, Stepper
from ._stream import StreamPosition
from ._tally import ReadBack, Tally
from ._values import (
    EXAMPLES,
    read_meta,
    read_root_values,
    root_values_receiver,
    write_meta,
    write_root_values,
)

__all__ = ["StepKernel"]


@attrs.define(eq=False)
class StepKernel:
    """One rank's passes on its compute thread. ``stepper`` is the root's optimizer, and
    every rank's with ``step_on="every_rank"`` or ``"sharded"``; followers stepping on the
    root hold none.

    Every method runs on the compute thread, which owns every field: the event loop reads
    none of them while a pass runs.
    """

    rank: int
    clique: Clique
    model: SupervisedModel
    flat: FlatParameters
    options: StepOptions
    stepper: Stepper | None = None
    loss_scale: LossScale = attrs.field()
    _buckets: GradientBuckets | None = attrs.field(default=None, init=False)
    _sent: list[PendingCollective] = attrs.field(factory=list, init=False)
    _read_back: ReadBack | None = attrs.field(default=None, init=False)
    position: StreamPosition | None = attrs.field(default=None, init=False)
    """With ``steps_per_epoch``: the rank's place in its training stream after the last
    window (what a checkpoint stores)."""
    _metrics: MetricTally | None = attrs.field(default=None, init=False)
    """The pass's metrics, when the model has some."""
    _first_batch: int = attrs.field(default=0, init=False)
    """The feed's batches taken before the pass (a batch's index in the pass is its number in
    the feed less these)."""
    _non_finite: NonFiniteSteps = attrs.field(init=False)

    @loss_scale.default
    def _default_loss_scale(self) -> LossScale:
        if self.stepper is not None:
            return self.stepper.loss_scale
        return LossScale(enabled=self.options.autocast_dtype == torch.float16)

    @_non_finite.default
    def _default_non_finite(self) -> NonFiniteSteps:
        names = names_every_rank(
            device=self.device,
            nranks=self.clique.nranks,
            step_on=self.options.step_on,
            skips=self.options.non_finite_loss == "skip",
            loss_scaling=self.loss_scale.enabled,
        )
        return NonFiniteSteps(
            rank=self.rank,
            nranks=self.clique.nranks,
            policy=self.options.non_finite_loss,
            gather=self._all_gather if names else None,
        )

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

    @property
    def sharded(self) -> bool:
        """Whether each rank steps its own slice of the flat buffers."""
        return self.flat.shards > 1

    @property
    def _all_reduces_shards(self) -> bool:
        """Whether a sharded step all-reduces whole gradient buffers, the meta values behind
        them, instead of reduce-scattering them: over Gloo, whose reduce-scatter costs an
        all-reduce of the whole buffer, so the meta values ride in it for free."""
        return self.clique.backend == "gloo"

    # -- between passes ----------------------------------------------------------------------

    def _check_thread(self) -> None:
        """Refuse to run on an event loop: the kernel waits for peers and for the device."""
        if on_event_loop_thread():
            raise RuntimeError(
                f"rank {self.rank}: the step kernel runs on the rank's compute thread, not on "
                "an event loop; start passes through PassRunner"
            )

    def sync_parameters(self) -> None:
        """Broadcast the root's parameters and buffers so that every rank holds them."""
        self._check_thread()
        if not self.alone:
            tensors = [*self.flat.parameter_buffers, *self.flat.module_buffers]
            self.clique.start_broadcast(tensors).wait_blocking(None)

    def sync_optimizer_state(self) -> None:
        """Give every rank the root's optimizer state (for ``step_on="every_rank"``), or
        sharded, each rank its slice of the state the root resumed from (none for a new
        run)."""
        stepper = self.stepper
        assert stepper is not None
        self._check_thread()
        if self.alone:
            return
        state = None
        if self.is_root:
            state = stepper.resumed_state if self.sharded else stepper.optimizer.state_dict()
            stepper.resumed_state = None
        # Sharded, the whole state stays in host memory: each rank moves its slice only.
        location = "cpu" if self.sharded else self.device
        state = broadcast_object(self.clique, state, rank=self.rank, map_location=location)
        if state is not None and not self.is_root:
            stepper.load_state_dict(state)
            stepper.resumed_state = None

    def checkpoint_parts(self) -> CheckpointParts | None:
        """What each rank holds of a checkpoint, gathered on the root (``None`` elsewhere):
        sharded, the whole optimizer state; and every rank's place in its training stream
        and RNG states. Every rank calls it, between passes."""
        self._check_thread()
        optimizer_state = None
        if self.stepper is not None and self.stepper.shard is not None:
            optimizer_state = self.stepper.shard.full_state_dict(self._all_gather)
        rng = capture_rng_states()
        mine = {
            "position": None if self.position is None else self.position.to_plain(),
            "rng_tensors": rng.tensors(),
            "rng_json": rng.to_json(),
        }
        ranks = gather_objects(self.clique, mine, rank=self.rank)
        if ranks is None:
            return None
        if optimizer_state is None and self.stepper is not None:
            optimizer_state = self.stepper.optimizer.state_dict()
        assert optimizer_state is not None
        return CheckpointParts(optimizer_state=optimizer_state, rank_states=tuple(ranks))

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
        if self.stepper is not None:
            self.stepper.set_lr_factor(lr_factor)
        self.model.module.train()
        self.flat.zero_gradients()
        started = time.perf_counter()
        # A training stream's feed lives across passes: count this pass's batches only.
        first_batch = self._first_batch = feed.batches_read
        window = self.options.steps_per_epoch
        total = feed.total
        if window is not None:
            total = window * self.options.accumulate_gradient_over_n_batches
        if self._read_back is None and self.device.type == "cuda":
            self._read_back = ReadBack(self.device)
        tally = Tally(
            rank=self.rank, epoch=epoch, read_back=self._read_back, nranks=self.clique.nranks
        )
        per_step = self.options.learning_rate_per_step
        metrics = self._metrics = MetricTally.start(
            self.model, self.device, rank=self.rank, phase="train", epoch=epoch
        )
        last: PassEvent | None = None
        with self._attach_buckets():
            planned = window if window is not None else self._planned_steps(feed)
            step = 0
            more = True
            while more:
                if feed.stopped:
                    raise PassStopped
                if per_step is not None and self.stepper is not None:
                    assert window is not None  # StepOptions checks it
                    self.stepper.set_lr_factor(lr_factor * per_step.factor(epoch * window + step))
                if self.alone:
                    more = self._solo_step(feed, epoch, step, tally)
                else:
                    more = self._train_step(feed, epoch, step, tally, planned)
                step += 1
                if planned is not None:
                    more = step < planned
                if self.stepper is not None:
                    tally.poll()
                    if not more:
                        tally.drain()
                if progress is not None:
                    event = PassEvent(
                        epoch=epoch,
                        kind="train",
                        pass_index=pass_index,
                        step=tally.steps_read,
                        batches=feed.batches_read - first_batch,
                        total_batches=total,
                        examples=tally.examples,
                        loss=tally.loss,
                        seconds=time.perf_counter() - started,
                        done=not more,
                    )
                    if more:
                        progress.publish(event)
                    else:
                        last = event  # with the pass's metrics, once they are summed
        self._settle_sent()
        values = self._sum_metrics(metrics)
        if progress is not None and last is not None:
            progress.publish(attrs.evolve(last, metrics=values))
        if self.options.steps_per_epoch is not None:
            self.position = feed.position
            if self.position is None:
                raise AssertionError("a window ended on a batch without its stream position")
        if self.stepper is None:
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

    def _train_step(
        self, feed: BatchFeed, epoch: int, step: int, tally: Tally, planned: int | None
    ) -> bool:
        """One training step over up to ``accumulate`` batches: forward and backward of each
        (the last one starts the gradient buckets as it goes), then :meth:`_synchronise`.
        Returns whether any rank has more batches (see there)."""
        loss_sum: torch.Tensor | None = None
        examples = 0
        accumulate = self.options.accumulate_gradient_over_n_batches
        if self.sharded:
            self._settle_sent()  # the last step's parameters, before this step's forward
        for index in range(accumulate):
            batch = feed.next()
            if batch is None:
                break
            if batch.examples == 0:
                continue
            if index == accumulate - 1 and self._buckets is not None:
                self._buckets.arm()  # the step's last backward: start buckets as they fill
            loss = self._weighted_loss(batch, "train", epoch, weight=batch.examples)
            loss_sum = loss if loss_sum is None else loss_sum + loss
            examples += batch.examples
        more = feed.has_next()  # after the backward: the next batch loaded meanwhile
        if loss_sum is None:
            loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        # Behind the gradients unless alone (nothing is sent), bucketing (the buckets'
        # exchanges start before the meta values are known) or reduce-scattering.
        tail = not self.alone and self._buckets is None
        tail = tail and (not self.sharded or self._all_reduces_shards)
        meta = write_meta(self.flat, examples, loss_sum, more, tail=tail)
        return self._synchronise(meta, loss_sum, examples, more, epoch, step, tally, planned)

    def _solo_step(self, feed: BatchFeed, epoch: int, step: int, tally: Tally) -> bool:
        """One training step of a rank alone in its clique: a plain loop's step.

        With nothing to exchange, each batch's loss is weighted by its share of the step's
        examples before backward (the step's batches are taken first), so the gradients are
        the step's average as they come out of backward: no division pass, no gradient
        buffers to fill, the gradients set to ``None`` after the step. Returns whether the
        source has more batches."""
        batches: list[LoadedBatch] = []
        for _ in range(self.options.accumulate_gradient_over_n_batches):
            batch = feed.next()
            if batch is None:
                break
            if batch.examples > 0:
                batches.append(batch)
        examples = sum(batch.examples for batch in batches)
        # The step's loss sum: a batch's mean loss times its examples on the host, or the
        # float64 sum of several on the device.
        losses = [
            self._model_loss(batch, "train", epoch, weight=batch.examples / examples)
            for batch in batches
        ]
        more = feed.has_next()  # after the backward: the next batch loaded meanwhile
        stepper = self.stepper
        assert stepper is not None  # a rank alone is the root
        if not losses:
            tally.record(0, 0.0, counted=False)
            return more
        if len(losses) == 1:
            loss_sum, factor = losses[0], float(examples)
        else:
            loss_sum, factor = losses[0].to(torch.float64) * batches[0].examples, 1.0
            for loss, batch in zip(losses[1:], batches[1:], strict=True):
                loss_sum = loss_sum + loss.to(torch.float64) * batch.examples
        if stepper.needs_host_values:
            value = loss_sum.item() * factor
            if not math.isfinite(value):
                stepper.skip()
                tally.record(examples, value, counted=False)
                self._non_finite.settle(epoch=epoch, step=step, summed=value, own=loss_sum * factor)
                return more
            counted = stepper.step(examples, epoch=epoch, step=step, averaged=True)
            tally.record(examples, value, counted=counted)
        else:
            stepper.step_on_device(None)
            tally.submit_loss(step, examples, loss_sum, factor=factor)
        return more

    def _attach_buckets(self) -> AbstractContextManager[object]:
        """The gradient buckets' hooks for one pass (none when alone or not bucketing)."""
        cap = self.options.bucket_cap_mb
        if self.alone or cap is None:
            return nullcontext()
        if self._buckets is None:
            self._buckets = GradientBuckets.create(
                self.rank,
                self.flat,
                self._start_gradient_exchange,
                bucket_cap_mb=cap,
                whole_buffers=self.sharded,
            )
        return self._buckets.attached()

    def _start_gradient_exchange(self, tensors: Sequence[torch.Tensor]) -> PendingCollective:
        """Start the sum of ``tensors`` over the clique: to every rank, to the root, or
        sharded (one padded gradient buffer), each rank's slice to that rank, in place."""
        if self.sharded:
            (padded,) = tensors
            return self.clique.start_reduce_scatter(self.flat.shard(padded, self.rank), padded)
        if self.options.step_on == "every_rank":
            return self.clique.start_all_reduce(tensors)
        return self.clique.start_reduce(tensors, root=0)

    def _settle_sent(self) -> None:
        """Wait for the root's last parameter broadcast, or sharded, the last all-gathers of
        the parameters (their errors, if any, surface here)."""
        sent, self._sent = self._sent, []
        for pending in sent:
            pending.wait_blocking(None)

    def _sum_metrics(self, metrics: MetricTally | None) -> dict[str, float | tuple[float, ...]]:
        """A training pass's metrics over the clique, on the root (one reduce of their own;
        empty elsewhere and without metrics)."""
        if metrics is None:
            return {}
        summed = metrics.local()
        if not self.alone:
            self.clique.start_reduce([summed], root=0).wait_blocking(None)
        return metrics.values(summed) if self.is_root else {}

    def _sum_over_clique(self, tensor: torch.Tensor) -> None:
        """Sum a small tensor over the clique in place, and wait (a sharded step's scalars)."""
        self.clique.start_all_reduce([tensor]).wait_blocking(None)

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.clique.start_all_gather(output, input).wait_blocking(None)

    def _start_parameter_gathers(self) -> None:
        """Sharded: start gathering every rank's stepped slice into every parameter buffer,
        first layers first; the next forward waits for them (see :meth:`_settle_sent`)."""
        self._sent = [
            self.clique.start_all_gather(storage, self.flat.shard(storage, self.rank))
            for storage in self.flat.parameter_storage
        ]

    def _planned_steps(self, feed: BatchFeed) -> int | None:
        """The pass's step count when every rank's source has a length, else ``None`` (then
        each step carries a flag saying whether any rank has more batches)."""
        accumulate = self.options.accumulate_gradient_over_n_batches
        local = -1 if feed.total is None else feed.total
        if self.alone:
            lengths = [local]
        else:
            mine = host_to_device([local], torch.int64, self.device)
            gathered = torch.zeros(self.clique.nranks, dtype=torch.int64, device=self.device)
            self.clique.start_all_gather(gathered, mine).wait_blocking(None)
            lengths = [int(n) for n in gathered.tolist()]
        if min(lengths) < 0:
            return None
        return max(1, *(-(-n // accumulate) for n in lengths))

    def _synchronise(
        self,
        meta: torch.Tensor | None,
        own_loss: torch.Tensor,
        local_examples: int,
        local_more: bool,
        epoch: int,
        step: int,
        tally: Tally,
        planned: int | None,
    ) -> bool:
        """Combine the step's gradients over the clique and step where the optimizer lives.

        ``meta`` is the step's meta tensor when it travels on its own, ``None`` when it rides
        behind the gradients (see ``_values``); ``own_loss`` is this rank's loss sum of the
        step. Returns whether any rank has more batches (only meaningful when ``planned`` is
        None).
        On CUDA a stepping rank reads the reduced values on the host before it steps only when
        it must: the skip policy, fp16 loss scaling, no examples of its own (so that it cannot
        know the clique had some), or no plan and no batch of its own left (so that it cannot
        know whether another rank has one; with a batch left, ``local_more``, it knows that the
        clique has). Otherwise it steps on the device and the tally reads the values back
        later. A follower reads the root values for the same reasons, and where the root may
        ask for its own loss (see ``_blame``). On the CPU, where reading waits for nothing,
        every rank reads them at once.
        A step whose summed loss is not finite is skipped, and raises or warns once the ranks
        whose own loss was not finite are known (see ``_blame``).
        """
        learn_more = planned is None and not local_more
        if not self.alone:
            own = [] if meta is None else [meta]
            if self._buckets is not None:
                exchanges = self._buckets.start_remaining()
            elif self.sharded and meta is not None:
                exchanges = [
                    self._start_gradient_exchange([padded])
                    for padded in reversed(self.flat.padded_gradients)
                ]
            else:
                own = [*self.flat.gradient_storage, *own]
                exchanges = []
            if self.sharded:
                exchanges.append(self.clique.start_all_reduce(own))
            else:
                exchanges.append(self._start_gradient_exchange(own))
            self._settle_sent()
            for exchange in exchanges:
                exchange.wait_blocking(None)
        if self.stepper is None:
            self.flat.zero_gradients()  # the reduce left partial sums in them
            return self._receive_parameters(read=learn_more, own_loss=own_loss)
        stepper = self.stepper
        must_read = learn_more or stepper.needs_host_values or local_examples == 0
        values = read_meta(self.flat, meta)  # before the step zeroes the gradients' tail
        combine: Combine | None = self._sum_over_clique if self.sharded else None
        non_finite: float | None = None
        if must_read or self.device.type != "cuda":
            examples, loss_sum, flag = values.tolist()
            more = bool(flag > 0) if must_read else True
            if examples > 0 and not math.isfinite(loss_sum):
                stepper.skip()
                tally.record(examples, loss_sum, counted=False)
                non_finite = loss_sum
            elif must_read:
                counted = stepper.step(examples, epoch=epoch, step=step, combine=combine)
                tally.record(examples, loss_sum, counted=counted)
            else:
                stepper.step_on_device(values[EXAMPLES], combine=combine)
                tally.record(examples, loss_sum, counted=True)
        else:
            stepper.step_on_device(values[EXAMPLES], combine=combine)
            tally.submit(step, values, own=own_loss)
            more = True
        if non_finite is not None and self.options.step_on != "root":
            # Every rank steps and reads the same sum: all are here, before the step's other
            # collectives, where they gather their own losses (see _blame).
            self._non_finite.settle(epoch=epoch, step=step, summed=non_finite, own=own_loss)
        if self.alone:
            return more
        if self.sharded:
            self._start_parameter_gathers()
        if self.options.step_on != "root":
            if self.flat.module_buffers:
                self.clique.start_broadcast(self.flat.module_buffers).wait_blocking(None)
        else:
            ask = non_finite is not None and self._non_finite.gather is not None
            self._send_parameters(more, ask=ask)
            if non_finite is not None:
                # The followers read the ask behind the parameters and gather with the root.
                self._non_finite.settle(epoch=epoch, step=step, summed=non_finite, own=own_loss)
        return more

    def _send_parameters(self, more: bool, *, ask: bool = False) -> None:
        """Broadcast the stepped parameters, and behind them the root values (with ``ask``:
        the followers are to gather their own losses of the step with the root). On CUDA the
        root's next forward only reads them, so it need not wait, unless the broadcast carries
        module buffers (which a forward in train mode may update in place); the next step's
        exchange waits for it at the latest. On the CPU the root waits: the broadcast's threads
        would compete with its forward."""
        values = write_root_values(self.flat, more, self.loss_scale.scale, self.device, ask=ask)
        own = [] if values is None else [values]
        sent = self.clique.start_broadcast(
            [*self.flat.parameter_storage, *self.flat.module_buffers, *own], root=0
        )
        if self.flat.module_buffers or self.device.type != "cuda":
            sent.wait_blocking(None)
        else:
            self._sent = [sent]

    def _receive_parameters(self, *, read: bool, own_loss: torch.Tensor) -> bool:
        """Receive the root's parameters; read the root values (a host sync on CUDA) only
        when ``read``, when fp16 loss scaling needs the scale, or when the root may ask for
        this rank's own loss of the step (``own_loss``; see ``_blame``), and answer it."""
        values = root_values_receiver(self.flat, self.device)
        own = [] if values is None else [values]
        if not self.alone:
            self.clique.start_broadcast(
                [*self.flat.parameter_storage, *self.flat.module_buffers, *own], root=0
            ).wait_blocking(None)
        may_ask = self._non_finite.gather is not None
        if not read and not self.loss_scale.enabled and not may_ask:
            return True
        more, self.loss_scale.scale, ask = read_root_values(self.flat, values).tolist()
        if ask > 0:
            self._non_finite.own_losses(own_loss)
        return bool(more > 0)

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
        while (batch := feed.next()) is not None:
            if feed.stopped:
                raise PassStopped
            if batch.examples == 0:
                continue
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
        self, batch: LoadedBatch, phase: PassKind, epoch: int, *, weight: float | None
    ) -> torch.Tensor:
        """The batch's mean loss, detached. With ``weight``, first the backward of the mean
        loss times ``weight`` (times the fp16 loss scale); without, evaluated without
        gradients. The pass's metrics take the same forward's output. User errors come back
        naming the rank, the batch's index in the pass and its shapes."""
        metrics = self._metrics
        try:
            if weight is None:
                with torch.no_grad(), self._autocast():
                    loss, output = self._forward(batch)
            else:
                with self._autocast():
                    loss, output = self._forward(batch)
                factor = weight * self.loss_scale.factor
                weighted = loss if factor == 1.0 else loss * factor
                weighted.backward()  # type: ignore[no-untyped-call]  # torch's backward is untyped
                if self.flat.flat_gradients:
                    self.flat.ensure_gradient_views()
            if metrics is not None:
                with torch.no_grad():
                    metrics.update(output, batch.target)
        except LampdistError:
            raise
        except Exception as exc:
            index = batch.number - self._first_batch
            raise TrainingError(
                f"epoch {epoch}, batch {index}: the model raised {type(exc).__name__}: {exc} "
                f"({describe_batch(batch.inputs, batch.target)})",
                rank=self.rank,
                phase=phase,
            ) from exc
        return loss.detach()

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
