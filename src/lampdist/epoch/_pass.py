"""One pass over a rank's batches on the clique: training steps and validation.

A training step, on every rank: forward and backward over up to ``accumulate`` batches with
each batch's mean loss weighted by its example count, so the flat gradient buffers hold sums.
With ``step_on="root"`` the gradients are reduced to the root after backward (or, with
``bucket_cap_mb``, bucket by bucket while the last backward still runs: see ``_buckets``),
with the step's ``meta`` values (examples, loss sum, whether this rank has more batches)
behind them (see ``_values``); the root divides by the clique's example count, steps and
broadcasts the parameters, the module's buffers and its control values (a ``more`` flag,
the loss scale) behind them. With
``step_on="every_rank"`` the same tensors are all-reduced and every rank steps. The pass ends
when no rank has batches left. Either way the update equals one process stepping on the
concatenation of every rank's batches of the step.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import attrs
import torch

from .._effects import BatchSource
from .._errors import LampdistError, TrainingError
from ..clique import Clique, PendingCollective
from ._batches import BatchReader, LoadedBatch, open_batches
from ._buckets import GradientBuckets
from ._compute import Compute
from ._device import host_to_device
from ._flat import FlatModel
from ._model import SupervisedModel
from ._options import OnPassEvent, PassEvent, PassResult, TrainingOptions
from ._stepper import LossScale, Stepper
from ._tally import Tally
from ._values import (
    EXAMPLES,
    control_receiver,
    read_control,
    read_meta,
    write_control,
    write_meta,
)

__all__ = ["RankRunner"]


@attrs.define(eq=False)
class RankRunner:
    """Runs the passes of one rank. ``stepper`` is the root's optimizer, and every rank's with
    ``step_on="every_rank"``; followers stepping on the root hold none."""

    rank: int
    clique: Clique
    model: SupervisedModel
    flat: FlatModel
    options: TrainingOptions
    stepper: Stepper | None = None
    on_event: OnPassEvent | None = None
    loss_scale: LossScale = attrs.field()
    _compute: Compute = attrs.field(factory=Compute, init=False)
    _buckets: GradientBuckets | None = attrs.field(default=None, init=False)
    _sent: PendingCollective | None = attrs.field(default=None, init=False)

    @loss_scale.default
    def _default_loss_scale(self) -> LossScale:
        if self.stepper is not None:
            return self.stepper.loss_scale
        return LossScale(enabled=self.options.autocast_dtype == torch.float16)

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

    async def sync_parameters(self) -> None:
        """Broadcast the root's parameters and buffers so that every rank holds them."""
        if self.alone:
            return
        await self.clique.broadcast([*self.flat.parameter_buffers, *self.flat.module_buffers])

    async def sync_optimizer_state(self) -> None:
        """Give every rank the root's optimizer state (for ``step_on="every_rank"``)."""
        assert self.stepper is not None
        if self.alone:
            return
        async with self._compute.session():
            await self._send_optimizer_state(self.stepper.optimizer)

    async def _send_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """The root's optimizer state as bytes, its length first (inside a compute session)."""
        device = self.device
        length = torch.zeros(1, dtype=torch.int64, device=device)
        payload = torch.zeros(0, dtype=torch.uint8, device=device)
        if self.is_root:

            def serialise() -> torch.Tensor:
                buffer = io.BytesIO()
                torch.save(optimizer.state_dict(), buffer)
                data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
                return data.to(device)

            payload = await self._compute.run(serialise)
            length = host_to_device([payload.numel()], torch.int64, device)
        await self.clique.broadcast([length])
        if not self.is_root:
            (size,) = await self._to_host(length)
            payload = torch.zeros(int(size), dtype=torch.uint8, device=device)
        await self.clique.broadcast([payload])
        if not self.is_root:

            def load() -> None:
                state = torch.load(
                    io.BytesIO(payload.cpu().numpy().tobytes()),
                    map_location=device,
                    weights_only=True,
                )
                optimizer.load_state_dict(state)

            await self._compute.run(load)

    async def train_pass(
        self, source: BatchSource, *, epoch: int, pass_index: int, lr_factor: float
    ) -> PassResult:
        """One training pass; the result covers the whole clique where this rank steps."""
        if self.stepper is not None:
            self.stepper.set_lr_factor(lr_factor)
        self.model.module.train()
        self.flat.zero_gradients()
        started = time.perf_counter()
        tally = Tally(rank=self.rank, epoch=epoch)
        async with (
            self._compute.session(),
            open_batches(
                source, model=self.model, device=self.device, rank=self.rank, phase="train"
            ) as reader,
        ):
            with self._attach_buckets():
                planned = await self._planned_steps(reader)
                step = 0
                more = True
                while more:
                    more = await self._train_step(reader, epoch, step, tally, planned)
                    step += 1
                    if planned is not None:
                        more = step < planned
                    if self.stepper is not None:
                        tally.poll()
                        if not more:
                            await tally.drain()
                    if self.on_event is not None and self.is_root:
                        await self.on_event(
                            PassEvent(
                                epoch=epoch,
                                kind="train",
                                pass_index=pass_index,
                                step=tally.steps_read,
                                batches=reader.batches_read,
                                total_batches=reader.total,
                                examples=tally.examples,
                                loss=tally.loss,
                                seconds=time.perf_counter() - started,
                                done=not more,
                            )
                        )
            await self._compute.run(self._settle_sent, on_cancel=self._abort_clique)
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
            loss=tally.loss, examples=tally.examples, steps=step, skipped_steps=tally.skipped
        )

    def _attach_buckets(self) -> AbstractContextManager[object]:
        """The gradient buckets' hooks for one pass (none when alone or not bucketing)."""
        cap = self.options.bucket_cap_mb
        if self.alone or cap is None:
            return nullcontext()
        if self._buckets is None:
            self._buckets = GradientBuckets.create(
                self.rank, self.flat, self._start_gradient_exchange, bucket_cap_mb=cap
            )
        return self._buckets.attached()

    def _start_gradient_exchange(self, tensors: Sequence[torch.Tensor]) -> PendingCollective:
        """Start the sum of ``tensors`` over the clique: to every rank or to the root."""
        if self.options.step_on == "every_rank":
            return self.clique.start_all_reduce(tensors)
        return self.clique.start_reduce(tensors, root=0)

    def _settle_sent(self) -> None:
        """Wait for the root's last parameter broadcast (its errors, if any, surface here).
        Runs in a compute call."""
        sent, self._sent = self._sent, None
        if sent is not None:
            sent.wait_blocking(None)

    async def _planned_steps(self, reader: BatchReader) -> int | None:
        """The pass's step count when every rank's source has a length, else ``None`` (then
        each step carries a flag saying whether any rank has more batches)."""
        accumulate = self.options.accumulate_gradient_over_n_batches
        local = -1 if reader.total is None else reader.total
        if self.alone:
            lengths = [local]
        else:
            mine = host_to_device([local], torch.int64, self.device)
            gathered = torch.zeros(self.clique.nranks, dtype=torch.int64, device=self.device)
            await self.clique.all_gather(gathered, mine)
            lengths = [int(n) for n in await self._to_host(gathered)]
        if min(lengths) < 0:
            return None
        return max(1, *(-(-n // accumulate) for n in lengths))

    def _finish_step(
        self,
        last: LoadedBatch | None,
        loss_sum: torch.Tensor | None,
        examples: int,
        more: bool,
        epoch: int,
        step: int,
        tally: Tally,
        planned: int | None,
    ) -> bool:
        """Runs in a compute call: forward and backward of the step's last batch (which
        starts the gradient buckets as it goes), then :meth:`_synchronise`. ``loss_sum`` is
        that of the step's earlier batches (``None`` when there were none)."""
        if last is not None:
            if self._buckets is not None:
                self._buckets.arm()
            loss_sum = self._add_loss(loss_sum, self._forward_backward, last, "train", epoch)
            examples += last.examples
        if loss_sum is None:
            loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        # Behind the gradients unless alone (nothing is sent) or bucketing (the buckets'
        # exchanges start before the meta values are known).
        tail = not self.alone and self._buckets is None
        meta = write_meta(self.flat, examples, loss_sum, more, tail=tail)
        return self._synchronise(meta, examples, more, epoch, step, tally, planned)

    def _synchronise(
        self,
        meta: torch.Tensor | None,
        local_examples: int,
        local_more: bool,
        epoch: int,
        step: int,
        tally: Tally,
        planned: int | None,
    ) -> bool:
        """Runs in a compute call: combine the step's gradients over the clique and step
        where the optimizer lives.

        ``meta`` is the step's meta tensor when it travels on its own, ``None`` when it rides
        behind the gradients (see ``_values``). Returns whether any rank has more batches
        (only meaningful when ``planned`` is None).
        A stepping rank reads the reduced values on the host before it steps only when it must:
        the skip policy, fp16 loss scaling, no examples of its own (so that it cannot know the
        clique had some), or no plan and no batch of its own left (so that it cannot know
        whether another rank has one; with a batch left, ``local_more``, it knows that the
        clique has). Otherwise it steps on the device and the tally reads the values back
        later. A follower reads the root's control values for the same reason only.
        """
        learn_more = planned is None and not local_more
        if not self.alone:
            own = [] if meta is None else [meta]
            if self._buckets is not None:
                exchanges = self._buckets.start_remaining()
                exchanges.append(self._start_gradient_exchange(own))
            else:
                exchanges = [self._start_gradient_exchange([*self.flat.gradient_storage, *own])]
            self._settle_sent()
            for exchange in exchanges:
                exchange.wait_blocking(None)
        if self.stepper is None:
            self.flat.zero_gradients()  # the reduce left partial sums in them
            return self._receive_parameters(read=learn_more)
        stepper = self.stepper
        must_read = learn_more or stepper.needs_host_values or local_examples == 0
        values = read_meta(self.flat, meta)  # before the step zeroes the gradients' tail
        if must_read:
            examples, loss_sum, flag = values.tolist()
            counted = stepper.step(examples, loss_sum, epoch=epoch, step=step)
            tally.record(examples, loss_sum, counted=counted)
            more = bool(flag > 0)
        else:
            stepper.step_on_device(values[EXAMPLES])
            tally.submit(step, values)
            more = True
        if self.alone:
            return more
        if self.options.step_on == "every_rank":
            if self.flat.module_buffers:
                self.clique.start_broadcast(self.flat.module_buffers).wait_blocking(None)
        else:
            self._send_parameters(more)
        return more

    async def validation_pass(
        self, source: BatchSource, *, epoch: int, pass_index: int
    ) -> PassResult:
        """One validation pass in eval mode without gradients; one reduce at the end."""
        self.model.module.eval()
        started = time.perf_counter()
        loss_sum: torch.Tensor | None = None
        examples = 0
        async with (
            self._compute.session(),
            open_batches(
                source, model=self.model, device=self.device, rank=self.rank, phase="valid"
            ) as reader,
        ):
            while (batch := await reader.next()) is not None:
                if batch.examples == 0:
                    continue
                loss_sum = await self._compute.run(
                    self._add_loss, loss_sum, self._evaluate, batch, "valid", epoch
                )
                examples += batch.examples
            batches = reader.batches_read
            meta = host_to_device([examples, 0.0], torch.float64, self.device)
            if loss_sum is not None:
                meta[1] = loss_sum
            if not self.alone:
                await self.clique.reduce([meta], root=0)
            if not self.is_root:
                return PassResult(loss=math.nan, examples=examples, steps=0)
            total_examples, total_loss = await self._to_host(meta)
        if total_examples == 0:
            raise TrainingError(
                f"epoch {epoch}: the validation pass saw no examples on any rank; "
                "check validation_batches",
                rank=self.rank,
                phase="valid",
            )
        loss = total_loss / total_examples
        if self.on_event is not None:
            await self.on_event(
                PassEvent(
                    epoch=epoch,
                    kind="valid",
                    pass_index=pass_index,
                    step=0,
                    batches=batches,
                    total_batches=batches,
                    examples=int(total_examples),
                    loss=loss,
                    seconds=time.perf_counter() - started,
                    done=True,
                )
            )
        return PassResult(loss=loss, examples=int(total_examples), steps=0)

    def _add_loss(
        self,
        total: torch.Tensor | None,
        function: Callable[[LoadedBatch], torch.Tensor],
        batch: LoadedBatch,
        phase: str,
        epoch: int,
    ) -> torch.Tensor:
        """Runs in a compute call: ``total`` plus the example-weighted loss that
        ``function(batch)`` returns (that loss alone when ``total`` is ``None``), so that the
        event loop never touches the device. User errors come back naming the rank."""
        try:
            loss = function(batch)
        except LampdistError:
            raise
        except Exception as exc:
            raise TrainingError(
                f"epoch {epoch}: the model raised {type(exc).__name__}: {exc}",
                rank=self.rank,
                phase=phase,
            ) from exc
        return loss if total is None else total + loss

    async def _train_step(
        self, reader: BatchReader, epoch: int, step: int, tally: Tally, planned: int | None
    ) -> bool:
        """One training step over up to ``accumulate`` batches; returns whether any rank has
        more batches (see :meth:`_synchronise`).

        Each batch before the last runs forward and backward in a worker-thread call of its
        own; the last batch, the exchange and the optimizer step run in one more call, so a
        step leaves the event loop once when ``accumulate`` is 1. If this task is cancelled
        meanwhile, the clique is aborted so that the call stops waiting for its peers.
        """
        loss_sum: torch.Tensor | None = None
        examples = 0
        last = None
        accumulate = self.options.accumulate_gradient_over_n_batches
        for index in range(accumulate):
            batch = await reader.next()
            if batch is None:
                break
            if batch.examples == 0:
                continue
            if index == accumulate - 1:
                last = batch
                break
            loss_sum = await self._compute.run(
                self._add_loss, loss_sum, self._forward_backward, batch, "train", epoch
            )
            examples += batch.examples
        more = await reader.has_next()
        return await self._compute.run(
            self._finish_step,
            last,
            loss_sum,
            examples,
            more,
            epoch,
            step,
            tally,
            planned,
            on_cancel=self._abort_clique,
        )

    def _abort_clique(self) -> None:
        """Free a compute call that waits for its peers when this rank is cancelled."""
        self.clique.abort(f"rank {self.rank} was cancelled while training")

    def _forward_backward(self, batch: LoadedBatch) -> torch.Tensor:
        """Runs in a compute call: backward of the example-weighted loss; returns it."""
        with self._autocast():
            loss = self.model.forward_loss(batch.inputs, batch.target)
        weighted = loss * batch.examples
        scaled = weighted * self.loss_scale.factor if self.loss_scale.enabled else weighted
        scaled.backward()  # type: ignore[no-untyped-call]  # torch's backward is untyped
        self.flat.ensure_gradient_views()
        return weighted.detach().to(torch.float64)

    def _evaluate(self, batch: LoadedBatch) -> torch.Tensor:
        """Runs in a compute call: the example-weighted loss without gradients."""
        with torch.no_grad(), self._autocast():
            loss = self.model.forward_loss(batch.inputs, batch.target)
        return loss.detach().to(torch.float64) * batch.examples

    def _autocast(self) -> torch.autocast:
        dtype = self.options.autocast_dtype
        return torch.autocast(
            device_type=self.device.type, dtype=dtype or torch.float32, enabled=dtype is not None
        )

    def _send_parameters(self, more: bool) -> None:
        """Runs in a compute call: broadcast the stepped parameters. On CUDA the root's
        next forward only reads them, so it need not wait, unless the broadcast carries
        module buffers (which a forward in train mode may update in place); the next step's
        exchange waits for it at the latest. On the CPU the root waits: the broadcast's
        threads would compete with its forward."""
        control = write_control(self.flat, more, self.loss_scale.scale, self.device)
        own = [] if control is None else [control]
        sent = self.clique.start_broadcast(
            [*self.flat.parameter_storage, *self.flat.module_buffers, *own], root=0
        )
        if self.flat.module_buffers or self.device.type != "cuda":
            sent.wait_blocking(None)
        else:
            self._sent = sent

    def _receive_parameters(self, *, read: bool) -> bool:
        """Runs in a compute call: receive the root's parameters; read its control values
        (a host sync on CUDA) only when ``read`` or when fp16 loss scaling needs the scale."""
        control = control_receiver(self.flat, self.device)
        own = [] if control is None else [control]
        if not self.alone:
            self.clique.start_broadcast(
                [*self.flat.parameter_storage, *self.flat.module_buffers, *own], root=0
            ).wait_blocking(None)
        if not read and not self.loss_scale.enabled:
            return True
        more, self.loss_scale.scale = read_control(self.flat, control).tolist()
        return bool(more > 0)

    async def _to_host(self, tensor: torch.Tensor) -> list[float]:
        """``tensor.tolist()``, off the event loop where it waits for the device."""
        if tensor.device.type == "cpu":
            return list(tensor.tolist())
        values = await self._compute.run(tensor.tolist)
        return list(values)
