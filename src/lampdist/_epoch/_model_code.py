"""The step kernel's model code: a batch's forward, and in training its backward.

:class:`ModelCode` runs the model on one batch for a training step (the designs call it
through the kernel's backward, see ``_designs``) or for a validation pass: the mean loss under
autocast where configured, its backward times the batch's weight and the fp16 loss scale, the
pass's metrics from the same forward's output, and a padding pass where a lockstep design needs
a forward from a rank without a batch. A model's error comes back naming the rank, the batch's
index in its pass and its shapes (or, where the design's collectives run inside the model, the
peer that left). Everything here runs on the rank's compute thread.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import attrs
import torch

from .._errors import BadBatch, LampdistError, TrainingError
from .._model import BatchModel, SupervisedModel
from .._source import PassKind
from ..clique import Clique
from ._blame import describe_any_batch, describe_batch
from ._designs import Design
from ._feed import BatchFeed, LoadedBatch
from ._metrics import MetricTally

__all__ = ["ModelCode"]


@attrs.define(eq=False)
class ModelCode:
    """Rank ``rank``'s model code, for the passes of its step kernel (the compute thread)."""

    rank: int
    clique: Clique
    model: BatchModel
    design: Design
    lockstep: bool
    """Whether the design's collectives run inside the model, with other ranks (a model's
    error may then be a peer's that left)."""
    metrics: MetricTally | None = None
    """The pass's metrics, when the model has some."""
    last_batch: LoadedBatch | None = None
    """The last batch this rank ran forward (what a padding pass reruns)."""
    first_batch: int = 0
    """The feed's batches taken before the pass (a batch's index in the pass is its number in
    the feed less these)."""

    def start(self, feed: BatchFeed, phase: PassKind, epoch: int) -> MetricTally | None:
        """A pass over ``feed`` starts: its batches count from the feed's next one; its
        metrics (``None`` when the model has none)."""
        # A training stream's feed lives across passes: count this pass's batches only.
        self.first_batch = feed.batches_read
        self.metrics = MetricTally.start(
            self.model, self.clique.device, rank=self.rank, phase=phase, epoch=epoch
        )
        return self.metrics

    def loss(
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
        metrics = self.metrics
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
                    metrics.update(output, self.model.metric_target(batch.data))
        except BadBatch as exc:
            if exc.rank is not None:
                raise
            raise BadBatch(
                f"epoch {epoch}, batch {batch.number - self.first_batch}: {exc.message} "
                f"({self._describe(batch)})",
                rank=self.rank,
                phase=phase,
            ) from exc
        except LampdistError:
            raise
        except Exception as exc:
            if self.lockstep:
                # The design's collectives run inside the model: a peer that left makes them
                # raise here, and the clique knows which peer.
                failure = self.clique.explain(exc, phase)
                if failure is not None:
                    raise failure from exc
            index = batch.number - self.first_batch
            raise TrainingError(
                f"epoch {epoch}, batch {index}: the model raised {type(exc).__name__}: {exc} "
                f"({self._describe(batch)})",
                rank=self.rank,
                phase=phase,
            ) from exc
        return loss.detach()

    def weighted_loss(
        self, batch: LoadedBatch, phase: PassKind, epoch: int, *, weight: float | None
    ) -> torch.Tensor:
        """:meth:`loss` times the batch's weight (its examples or tokens, what the loss is a
        mean over), in float64 on the device."""
        loss = self.loss(batch, phase, epoch, weight=weight)
        return loss.to(torch.float64) * batch.weight

    def _describe(self, batch: LoadedBatch) -> str:
        """The batch's shapes, for an error message."""
        if isinstance(self.model, SupervisedModel):
            inputs, target = batch.data
            return describe_batch(inputs, target)
        return describe_any_batch(batch.data)

    def padding_pass(self, epoch: int, *, phase: PassKind, feed: BatchFeed) -> None:
        """A forward of the rank's last batch in eval mode with no metric (training: and its
        backward of weight 0), where this rank has no batch and a design that shards the model
        needs the collectives inside the forward and backward to meet the other ranks'.

        A rank that has run no batch yet (a run's first, or a lost rank's replacement that
        resumes its data on an empty batch) runs its next batch of ``feed`` whose weight is
        not 0 instead, without taking it: a padding pass adds nothing, whichever batch it
        runs."""
        batch = self.last_batch if self.last_batch is not None else feed.peek_weighted()
        if batch is None:
            raise TrainingError(
                f"epoch {epoch}: this rank has no batch and the other ranks run a forward: "
                f"under step_on={self.design.options.step_on!r} every rank runs each forward "
                "(a rank without a batch reruns its last one with weight 0); give every rank "
                "a non-empty batch",
                rank=self.rank,
                phase=phase,
            )
        module = self.model.module
        training = module.training
        module.eval()
        metrics, self.metrics = self.metrics, None
        try:
            self.loss(batch, phase, epoch, weight=0.0 if phase == "train" else None)
        finally:
            self.metrics = metrics
            module.train(training)

    def _forward(self, batch: LoadedBatch) -> tuple[torch.Tensor, Any]:
        """The batch's mean loss, and its output when the pass has metrics (else ``None``)."""
        if self.metrics is None:
            return self.model.batch_loss(batch.data), None
        return self.model.batch_loss_and_output(batch.data)

    def _autocast(self) -> AbstractContextManager[object]:
        dtype = self.design.options.autocast_dtype
        if dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.clique.device.type, dtype=dtype)
