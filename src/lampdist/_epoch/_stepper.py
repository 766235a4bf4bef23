"""The optimizer step: averaging, fp16 loss scaling, clipping and the non-finite loss policy."""

from __future__ import annotations

import logging
import math

import attrs
import torch

from .._errors import NonFiniteLoss
from .._options import StepOptions
from ._flat import FlatParameters

__all__ = ["LossScale", "Stepper"]

logger = logging.getLogger(__name__)


@attrs.define(eq=False)
class LossScale:
    """Dynamic loss scaling for fp16 autocast: halve the scale and skip the step when the
    averaged gradients overflow; double it after ``growth_interval`` clean steps."""

    enabled: bool
    scale: float = 2.0**16
    growth_interval: int = 2000
    _clean_steps: int = 0

    @property
    def factor(self) -> float:
        """What each rank multiplies its loss by before backward."""
        return self.scale if self.enabled else 1.0

    def update(self, gradients: list[torch.Tensor]) -> bool:
        """Whether ``gradients`` are finite; adjusts the scale (one host sync)."""
        finite = not gradients or bool(
            torch.stack([g.isfinite().all() for g in gradients]).all().item()
        )
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
class Stepper:
    """Steps the optimizer on the summed gradients of the whole clique.

    It keeps each param group's base learning rate: a pass's ``lr_factor`` scales them.
    """

    rank: int
    optimizer: torch.optim.Optimizer
    flat: FlatParameters
    options: StepOptions
    loss_scale: LossScale
    base_lrs: list[float]

    @classmethod
    def create(
        cls, rank: int, optimizer: torch.optim.Optimizer, flat: FlatParameters, options: StepOptions
    ) -> Stepper:
        """A stepper for ``optimizer``, whose current learning rates are the base ones."""
        return cls(
            rank=rank,
            optimizer=optimizer,
            flat=flat,
            options=options,
            loss_scale=LossScale(enabled=options.autocast_dtype == torch.float16),
            base_lrs=[float(group["lr"]) for group in optimizer.param_groups],
        )

    def set_lr_factor(self, factor: float) -> None:
        """Set every param group's learning rate to its base rate times ``factor``."""
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * factor

    @property
    def needs_host_values(self) -> bool:
        """Whether each step must read the clique's loss on the host before stepping (the
        skip policy and fp16 loss scaling decide per step; the rest can step on the device)."""
        return self.options.non_finite_loss == "skip" or self.loss_scale.enabled

    def step_on_device(self, examples: torch.Tensor | None) -> None:
        """Average over ``examples`` (a device scalar, known to be > 0; ``None`` when the
        losses were averaged before backward) and step, without waiting for the device."""
        try:
            if examples is not None:
                for grads in self.flat.gradient_buffers:
                    grads.div_(examples)
            if self.options.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.flat.parameters, self.options.max_grad_norm)
            self.optimizer.step()
        finally:
            self.flat.zero_gradients()

    def step(
        self, examples: float, loss_sum: float, *, epoch: int, step: int, averaged: bool = False
    ) -> bool:
        """Average the summed gradients over ``examples`` and step (``averaged``: the losses
        were weighted by their share of ``examples`` before backward, so the gradients are
        averages already).

        Returns whether the step's loss counts towards the pass's mean: a step skipped for a
        non-finite loss does not, one skipped for an fp16 overflow does. Raises
        :class:`NonFiniteLoss` under ``non_finite_loss="raise"``.
        """
        try:
            if examples == 0:
                return False
            if not math.isfinite(loss_sum):
                where = f"epoch {epoch}, step {step}"
                if self.options.non_finite_loss == "raise":
                    raise NonFiniteLoss(
                        f"{where}: the summed loss of the step is {loss_sum}; pass "
                        "non_finite_loss='skip' to skip such steps",
                        rank=self.rank,
                        phase="train",
                    )
                logger.warning("%s: skipping a step whose loss is %s", where, loss_sum)
                return False
            divisor = (1.0 if averaged else examples) * self.loss_scale.factor
            gradients = self.flat.gradients()
            if divisor != 1.0:
                for grads in gradients:
                    grads.div_(divisor)
            if self.loss_scale.enabled and not self.loss_scale.update(gradients):
                logger.info(
                    "epoch %d, step %d: fp16 gradients overflowed; skipping the step, "
                    "loss scale now %g",
                    epoch,
                    step,
                    self.loss_scale.scale,
                )
                return True
            if self.options.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.flat.parameters, self.options.max_grad_norm)
            self.optimizer.step()
            return True
        finally:
            self.flat.zero_gradients()
