"""One pass over a rank's batches on the clique: training steps and validation.

A training step, on every rank: forward and backward over up to ``accumulate`` batches with
each batch's mean loss weighted by its example count, so the gradient buffers hold sums; then
one reduce of the flat gradients and a small float64 ``meta`` tensor (examples, loss sum,
whether this rank has more batches) to the root. The root divides by the global example count,
clips, steps the optimizer and broadcasts the flat parameters, the module's buffers and a
``more`` flag. The pass ends when no rank has batches left. The update therefore equals one
process stepping on the concatenation of every rank's batches of the step.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Literal

import anyio
import anyio.to_thread
import attrs
import torch

from .._effects import BatchSource
from .._errors import ConfigError, LampdistError, NonFiniteLoss, TrainingError
from ..clique import Clique
from ._batches import BatchReader, LoadedBatch, open_batches
from ._flat import FlatModel
from ._model import SupervisedModel

__all__ = ["PassEvent", "PassResult", "RankRunner", "TrainingOptions"]

logger = logging.getLogger(__name__)

_META_EXAMPLES, _META_LOSS, _META_MORE = 0, 1, 2


@attrs.frozen(kw_only=True)
class TrainingOptions:
    """How a rank trains. ``accumulate_gradient_over_n_batches`` and ``autocast_dtype`` must
    agree on every rank (checked at join); ``max_grad_norm`` and ``non_finite_loss`` act on the
    root, which steps."""

    accumulate_gradient_over_n_batches: int = 1
    max_grad_norm: float | None = None
    autocast_dtype: torch.dtype | None = None
    non_finite_loss: Literal["raise", "skip"] = "raise"

    def __attrs_post_init__(self) -> None:
        if self.accumulate_gradient_over_n_batches < 1:
            raise ConfigError(
                "accumulate_gradient_over_n_batches must be >= 1, got "
                f"{self.accumulate_gradient_over_n_batches}: pass 1 to step after every batch"
            )
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
        if self.autocast_dtype not in (None, torch.bfloat16, torch.float16):
            raise ConfigError(
                f"autocast_dtype must be torch.bfloat16, torch.float16 or None, "
                f"got {self.autocast_dtype}"
            )
        if self.non_finite_loss not in ("raise", "skip"):
            raise ConfigError(
                f"non_finite_loss must be 'raise' or 'skip', got {self.non_finite_loss!r}"
            )

    def describe(self) -> str:
        """The settings every rank must share (the root-only ones excluded), for the agreement
        check at join."""
        return (
            f"accumulate_gradient_over_n_batches={self.accumulate_gradient_over_n_batches}, "
            f"autocast_dtype={self.autocast_dtype}"
        )


@attrs.frozen(kw_only=True)
class PassEvent:
    """Progress of a pass, reported on the root after every step and at the end.

    ``batches`` and ``examples`` count the whole clique's work so far in this pass (``batches``
    the root's own); ``loss`` is the example-weighted mean so far; ``total_batches`` is the
    root's batch count when its source has a length, else ``None``; ``done`` marks the last
    event of the pass.
    """

    epoch: int
    kind: Literal["train", "valid"]
    pass_index: int
    step: int
    batches: int
    total_batches: int | None
    examples: int
    loss: float
    seconds: float
    done: bool

    @property
    def examples_per_second(self) -> float:
        """Examples of the whole clique per second of this pass so far."""
        return self.examples / self.seconds if self.seconds > 0 else 0.0


OnPassEvent = Callable[[PassEvent], Awaitable[None]]


@attrs.frozen(kw_only=True)
class PassResult:
    """What a pass measured (on the root: for the whole clique)."""

    loss: float
    examples: int
    steps: int
    skipped_steps: int = 0


@attrs.define(eq=False)
class LossScale:
    """Dynamic loss scaling for fp16 autocast: the root halves the scale and skips the step
    when the averaged gradients overflow, and doubles it after ``growth_interval`` clean
    steps; followers receive the scale with the parameters."""

    enabled: bool
    scale: float = 2.0**16
    growth_interval: int = 2000
    _clean_steps: int = 0

    def update(self, gradients: list[torch.Tensor]) -> bool:
        """Whether ``gradients`` are finite; adjusts the scale (one host sync)."""
        finite = bool(torch.stack([g.isfinite().all() for g in gradients]).all().item())
        if not finite:
            self.scale /= 2.0
            self._clean_steps = 0
            return False
        self._clean_steps += 1
        if self._clean_steps >= self.growth_interval:
            self.scale *= 2.0
            self._clean_steps = 0
        return True


@attrs.define(eq=False)
class RankRunner:
    """Runs passes for one rank. The root's runner holds the optimizer and the base learning
    rate of each of its param groups (the schedule's factor scales them); followers' hold none."""

    rank: int
    clique: Clique
    model: SupervisedModel
    flat: FlatModel
    options: TrainingOptions
    optimizer: torch.optim.Optimizer | None = None
    base_lrs: list[float] = attrs.field(factory=list)
    on_event: OnPassEvent | None = None
    loss_scale: LossScale = attrs.field()
    _compute_limiter: anyio.CapacityLimiter = attrs.field(factory=lambda: anyio.CapacityLimiter(1))

    @loss_scale.default
    def _default_loss_scale(self) -> LossScale:
        return LossScale(enabled=self.options.autocast_dtype == torch.float16)

    @property
    def device(self) -> torch.device:
        """The rank's device."""
        return self.clique.device

    @property
    def is_root(self) -> bool:
        """Whether this runner steps the optimizer."""
        return self.optimizer is not None

    async def sync_parameters(self) -> None:
        """Broadcast the root's parameters and buffers so that every rank holds them."""
        await self.clique.broadcast([*self.flat.parameter_buffers, *self.flat.module_buffers])

    async def train_pass(
        self, source: BatchSource, *, epoch: int, pass_index: int, lr_factor: float
    ) -> PassResult:
        """One training pass; on the root the result covers every rank."""
        if self.optimizer is not None:
            for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
                group["lr"] = base * lr_factor
        self.model.module.train()
        self.flat.zero_gradients()
        started = time.perf_counter()
        total_loss = 0.0
        total_examples = 0
        steps = skipped = 0
        async with open_batches(
            source, model=self.model, device=self.device, rank=self.rank, phase="train"
        ) as reader:
            while True:
                meta = await self._accumulate(reader, epoch)
                await self.clique.reduce([*self.flat.gradient_buffers, meta], root=0)
                if self.optimizer is None:
                    self.flat.zero_gradients()
                    more = await self._receive_parameters()
                    steps += 1
                    if not more:
                        return PassResult(loss=math.nan, examples=0, steps=steps)
                    continue
                examples, loss_sum, more_ranks = meta.tolist()
                counted = await self._root_step(
                    examples, loss_sum, epoch=epoch, step=steps, batches=reader.batches_read
                )
                if counted:
                    total_loss += loss_sum
                    total_examples += int(examples)
                else:
                    skipped += int(examples > 0)
                steps += 1
                more = more_ranks > 0
                await self._send_parameters(more)
                if self.on_event is not None:
                    await self.on_event(
                        PassEvent(
                            epoch=epoch,
                            kind="train",
                            pass_index=pass_index,
                            step=steps,
                            batches=reader.batches_read,
                            total_batches=reader.total,
                            examples=total_examples,
                            loss=total_loss / total_examples if total_examples else math.nan,
                            seconds=time.perf_counter() - started,
                            done=not more,
                        )
                    )
                if not more:
                    break
        if total_examples == 0 and skipped == 0:
            raise TrainingError(
                f"epoch {epoch}: the training pass saw no examples on any rank; "
                "check train_batches",
                rank=self.rank,
                phase="train",
            )
        loss = total_loss / total_examples if total_examples else math.nan
        return PassResult(loss=loss, examples=total_examples, steps=steps, skipped_steps=skipped)

    async def validation_pass(
        self, source: BatchSource, *, epoch: int, pass_index: int
    ) -> PassResult:
        """One validation pass in eval mode without gradients; one reduce at the end."""
        self.model.module.eval()
        started = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        examples = 0
        async with open_batches(
            source, model=self.model, device=self.device, rank=self.rank, phase="valid"
        ) as reader:
            while (batch := await reader.next()) is not None:
                if batch.examples == 0:
                    continue
                loss_sum += await self._compute(self._evaluate, batch, "valid", epoch)
                examples += batch.examples
            batches = reader.batches_read
        meta = torch.zeros(2, dtype=torch.float64, device=self.device)
        meta[0] = examples
        meta[1] = loss_sum
        await self.clique.reduce([meta], root=0)
        if self.optimizer is None:
            return PassResult(loss=math.nan, examples=examples, steps=0)
        total_examples, total_loss = meta.tolist()
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

    async def _compute(
        self,
        function: Callable[[LoadedBatch], torch.Tensor],
        batch: LoadedBatch,
        phase: str,
        epoch: int,
    ) -> torch.Tensor:
        """Run ``function(batch)`` in a worker thread; user errors come back naming the rank."""
        try:
            return await anyio.to_thread.run_sync(function, batch, limiter=self._compute_limiter)
        except LampdistError:
            raise
        except Exception as exc:
            raise TrainingError(
                f"epoch {epoch}: the model raised {type(exc).__name__}: {exc}",
                rank=self.rank,
                phase=phase,
            ) from exc

    async def _accumulate(self, reader: BatchReader, epoch: int) -> torch.Tensor:
        """Forward and backward over up to ``accumulate`` batches; returns the step's meta."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        examples = 0
        for _ in range(self.options.accumulate_gradient_over_n_batches):
            batch = await reader.next()
            if batch is None:
                break
            if batch.examples == 0:
                continue
            loss_sum += await self._compute(self._forward_backward, batch, "train", epoch)
            examples += batch.examples
        more = await reader.has_next()
        meta = torch.zeros(3, dtype=torch.float64, device=self.device)
        meta[_META_EXAMPLES] = examples
        meta[_META_LOSS] = loss_sum
        meta[_META_MORE] = 1.0 if more else 0.0
        return meta

    def _forward_backward(self, batch: LoadedBatch) -> torch.Tensor:
        """Runs in a worker thread: backward of the example-weighted loss; returns it."""
        with self._autocast():
            loss = self.model.forward_loss(batch.inputs, batch.target)
        weighted = loss * batch.examples
        scaled = weighted * self.loss_scale.scale if self.loss_scale.enabled else weighted
        scaled.backward()  # type: ignore[no-untyped-call]  # torch's backward is untyped
        self.flat.ensure_gradient_views()
        return weighted.detach().to(torch.float64)

    def _evaluate(self, batch: LoadedBatch) -> torch.Tensor:
        """Runs in a worker thread: the example-weighted loss without gradients."""
        with torch.no_grad(), self._autocast():
            loss = self.model.forward_loss(batch.inputs, batch.target)
        return loss.detach().to(torch.float64) * batch.examples

    def _autocast(self) -> torch.autocast:
        dtype = self.options.autocast_dtype
        return torch.autocast(
            device_type=self.device.type, dtype=dtype or torch.float32, enabled=dtype is not None
        )

    async def _root_step(
        self, examples: float, loss_sum: float, *, epoch: int, step: int, batches: int
    ) -> bool:
        """Average, clip and step on the root; returns whether the step's loss counts (a step
        skipped for a non-finite loss does not; one skipped for an fp16 overflow does)."""
        assert self.optimizer is not None
        if examples == 0:
            self.flat.zero_gradients()
            return False
        if not math.isfinite(loss_sum):
            where = f"epoch {epoch}, step {step} (the root's batches up to #{batches - 1})"
            if self.options.non_finite_loss == "raise":
                raise NonFiniteLoss(
                    f"{where}: the summed loss is {loss_sum}; pass non_finite_loss='skip' to "
                    "skip such steps",
                    rank=self.rank,
                    phase="train",
                )
            logger.warning("%s: skipping a step whose loss is %s", where, loss_sum)
            self.flat.zero_gradients()
            return False
        await anyio.to_thread.run_sync(self._step, examples, limiter=self._compute_limiter)
        return True

    def _step(self, examples: float) -> None:
        assert self.optimizer is not None
        divisor = examples * (self.loss_scale.scale if self.loss_scale.enabled else 1.0)
        for grads in self.flat.gradient_buffers:
            grads.div_(divisor)
        if self.loss_scale.enabled and not self.loss_scale.update(self.flat.gradient_buffers):
            logger.info(
                "fp16 gradients overflowed: skipping the step, loss scale now %g",
                self.loss_scale.scale,
            )
            self.flat.zero_gradients()
            return
        if self.options.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.flat.parameters, self.options.max_grad_norm)
        self.optimizer.step()
        self.flat.zero_gradients()

    async def _send_parameters(self, more: bool) -> None:
        control = torch.tensor(
            [1.0 if more else 0.0, self.loss_scale.scale], dtype=torch.float64, device=self.device
        )
        await self.clique.broadcast(
            [*self.flat.parameter_buffers, *self.flat.module_buffers, control], root=0
        )

    async def _receive_parameters(self) -> bool:
        control = torch.zeros(2, dtype=torch.float64, device=self.device)
        await self.clique.broadcast(
            [*self.flat.parameter_buffers, *self.flat.module_buffers, control], root=0
        )
        more, self.loss_scale.scale = control.tolist()
        return bool(more > 0)
