"""The optimizer step: averaging, fp16 loss scaling and clipping.

A step whose summed loss is not finite never gets here: the step kernel checks the sum first,
skips the step (:meth:`Stepper.skip`) and applies the ``non_finite_loss`` policy (see
``_blame``).

A sharded stepper (``step_on="sharded"``) steps the rank's slice with its slice optimizer
(see ``_shard``): the clipping norm and the fp16 overflow check need the whole gradient, so
their one scalar each is summed over the clique through ``combine`` (see :data:`Combine`).
So does an fsdp stepper (``step_on="fsdp"``), whose optimizer steps FSDP2's sharded
parameters: it reads each gradient's local shard (``local_gradients``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from .._errors import ConfigError
from .._options import StepOptions
from ._flat import FlatParameters
from ._shard import ShardedOptimizer

__all__ = ["Combine", "LossScale", "Stepper"]

Combine = Callable[[torch.Tensor], None]
"""Sums a small float64 tensor over the clique in place and waits (a sharded step's norm and
overflow count); ``None`` where a rank holds whole gradients."""

logger = logging.getLogger(__name__)


def divide(gradients: list[torch.Tensor], examples: torch.Tensor) -> None:
    """Divide ``gradients`` in place by ``examples`` (a float64 device scalar, a count): one
    foreach division per dtype, the count cast to it where that is exact (float32 and
    float64: a foreach with a scalar of another dtype falls back to one kernel a tensor)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for gradient in gradients:
        by_dtype.setdefault(gradient.dtype, []).append(gradient)
    for dtype, group in by_dtype.items():
        exact = dtype in (torch.float32, torch.float64)
        torch._foreach_div_(group, examples.to(dtype) if exact else examples)


@attrs.define(eq=False)
class LossScale:
    """Dynamic loss scaling for fp16 autocast: halve the scale and skip the step when the
    averaged gradients overflow; double it after ``growth_interval`` clean steps."""

    enabled: bool
    scale: float = 2.0**16
    growth_interval: int = 2000
    _clean_steps: int = 0
    nominal: int = 0
    """The nominal step: the clique's largest step so far, in examples (0 before its first
    step; each new clique starts again), the same on every rank. Enabled, a rank weights each
    batch's loss by its share of it (:meth:`weight`), so that the scaled gradients summed
    over the clique are those of the step's mean loss, as ``GradScaler`` scales them, where
    the step has the nominal examples; a backward cannot know the step's own count without a
    collective."""

    @property
    def factor(self) -> float:
        """What each rank multiplies its loss by before backward."""
        return self.scale if self.enabled else 1.0

    def weight(self, examples: float) -> float:
        """The weight of ``examples`` in a step's gradient sums (a batch's, before backward;
        the clique's, to divide by): ``examples`` itself, or enabled and after the clique's
        first step, their share of :attr:`nominal`."""
        if not self.enabled or self.nominal == 0:
            return examples
        return examples / self.nominal

    def note(self, examples: float) -> None:
        """Count a step of the clique's ``examples`` towards :attr:`nominal` (enabled only)."""
        if self.enabled:
            self.nominal = max(self.nominal, int(examples))

    def update(self, gradients: list[torch.Tensor], combine: Combine | None = None) -> bool:
        """Whether ``gradients`` (with ``combine``: every rank's) are finite; adjusts the
        scale (one host sync)."""
        device = gradients[0].device if gradients else torch.device("cpu")
        overflowed = torch.zeros(1, dtype=torch.float64, device=device)
        if gradients:
            overflowed += torch.stack([~g.isfinite().all() for g in gradients]).sum()
        if combine is not None:
            combine(overflowed)
        finite = overflowed.item() == 0
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
    shard: ShardedOptimizer | None = None
    """The rank's slice optimizer when sharded (``optimizer`` is then its slice optimizer)."""
    local_gradients: Callable[[], list[torch.Tensor]] | None = None
    """fsdp: this rank's shard of every gradient (the parameters are sharded by FSDP2)."""
    resumed_state: dict[str, Any] | None = None
    """Sharded: the whole optimizer state the root resumed from, until the followers have
    taken their slices of it."""
    _norm_sum: torch.Tensor | None = attrs.field(default=None, init=False)
    _norm_max: torch.Tensor | None = attrs.field(default=None, init=False)
    _norm_steps: int = attrs.field(default=0, init=False)
    _norm_turn: int = attrs.field(default=0, init=False)
    """The steps since the pass's first, for ``grad_norm_every`` (the same on every rank that
    steps: they step, and skip, the same steps)."""

    @classmethod
    def create(
        cls,
        rank: int,
        optimizer: torch.optim.Optimizer,
        flat: FlatParameters,
        options: StepOptions,
        loss_scale: LossScale,
        *,
        shard: ShardedOptimizer | None = None,
        local_gradients: Callable[[], list[torch.Tensor]] | None = None,
    ) -> Stepper:
        """A stepper for ``optimizer``, whose current learning rates are the base ones (with
        ``shard``: the rank's slice optimizer, ``shard.optimizer``)."""
        return cls(
            rank=rank,
            optimizer=optimizer,
            flat=flat,
            options=options,
            loss_scale=loss_scale,
            base_lrs=[float(group["lr"]) for group in optimizer.param_groups],
            shard=shard,
            local_gradients=local_gradients,
        )

    def gradients(self) -> list[torch.Tensor]:
        """The gradients this rank steps on: its slices when sharded, its shards under fsdp,
        else all of them."""
        if self.shard is not None:
            return self.shard.gradients()
        if self.local_gradients is not None:
            return self.local_gradients()
        return self.flat.gradients()

    @property
    def flat_device(self) -> torch.device:
        """The device of the rank's parameters."""
        device: torch.device = next(iter(self.optimizer.param_groups[0]["params"])).device
        return device

    @property
    def sliced(self) -> bool:
        """Whether this rank holds a part of each gradient (sharded, fsdp), not all of it."""
        return self.shard is not None or self.local_gradients is not None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a whole optimizer's state (sharded: this rank's slice of it, kept for the
        followers' slices)."""
        if self.shard is None:
            self.optimizer.load_state_dict(state)
            return
        self.shard.load_full_state_dict(state)
        self.resumed_state = state

    def set_lr_factor(self, factor: float) -> None:
        """Set every param group's learning rate to its base rate times ``factor``."""
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * factor

    def set_lr_rates(self, factor: float, rates: float | Sequence[float]) -> None:
        """Set every param group's learning rate to ``factor`` times its rate of ``rates``
        (one for all, or one per group: a rate schedule's). Raises :class:`ConfigError` for
        one rate where the groups' base rates differ, and for as many rates as groups."""
        groups = self.optimizer.param_groups
        if isinstance(rates, Sequence):
            values = [float(rate) for rate in rates]
        else:
            if len(set(self.base_lrs)) > 1:
                raise ConfigError(
                    f"StepOptions.learning_rate_per_step: schedules.rate gave one learning "
                    f"rate for param groups built with different ones {self.base_lrs}; return "
                    f"one rate per group ({len(groups)}), or give a factor schedule",
                    rank=self.rank,
                    phase="configure",
                )
            values = [float(rates)] * len(groups)
        if len(values) != len(groups):
            raise ConfigError(
                f"StepOptions.learning_rate_per_step: schedules.rate gave {len(values)} learning "
                f"rates for {len(groups)} param groups; return one float or one per group",
                rank=self.rank,
                phase="configure",
            )
        for group, value in zip(groups, values, strict=True):
            group["lr"] = factor * value

    @property
    def needs_host_values(self) -> bool:
        """Whether each step must read the clique's loss on the host before stepping (the
        skip policy and fp16 loss scaling decide per step; the rest can step on the device)."""
        return self.options.non_finite_loss == "skip" or self.loss_scale.enabled

    def step_on_device(
        self, examples: torch.Tensor | None, *, combine: Combine | None = None
    ) -> None:
        """Average over ``examples`` (a device scalar, known to be > 0; ``None`` when the
        losses were averaged before backward) and step, without waiting for the device."""
        try:
            if examples is not None:
                divide(self.gradients(), examples)
            self._clip(combine)
            self.optimizer.step()
        finally:
            self.flat.zero_gradients()

    def _clip(self, combine: Combine | None) -> None:
        """Clip the averaged gradients by their global norm, if asked to: with whole
        gradients as ``clip_grad_norm_`` does; sharded or fsdp, over every rank's slices (the
        sum of squares through ``combine``, one scalar), with the same formula. The norm
        before clipping is kept for the pass (with ``max_grad_norm`` or
        ``measure_grad_norm``; without clipping the norm is the same formula's, and sliced it
        costs the one scalar's sum)."""
        max_norm = self.options.max_grad_norm
        if max_norm is None:
            if not self.options.measure_grad_norm:
                return
            turn, self._norm_turn = self._norm_turn, self._norm_turn + 1
            if turn % self.options.grad_norm_every:
                return  # not a step whose norm is measured
        if not self.sliced:
            if max_norm is None:
                whole = [p.grad for p in self.flat.parameters if p.grad is not None]
                self._keep_norm(torch.nn.utils.get_total_norm(whole))
            else:
                self._keep_norm(torch.nn.utils.clip_grad_norm_(self.flat.parameters, max_norm))
            return
        assert combine is not None
        gradients = self.gradients()
        norms = [torch.linalg.vector_norm(g).to(torch.float64) for g in gradients]
        if norms:
            squares = torch.stack(norms).square().sum().reshape(1)
        else:  # this rank holds no element of any gradient
            squares = torch.zeros(1, dtype=torch.float64, device=self.flat_device)
        combine(squares)
        norm = squares.sqrt()
        self._keep_norm(norm)
        if max_norm is None:
            return
        coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for grads in gradients:
            grads.mul_(coefficient.to(grads.dtype))

    def _keep_norm(self, norm: torch.Tensor) -> None:
        """Add a step's gradient norm to the pass's sum and maximum, on the device."""
        value = norm.detach().to(torch.float64).reshape(1)
        if self._norm_sum is None or self._norm_max is None:
            self._norm_sum = torch.zeros_like(value)
            self._norm_max = torch.zeros_like(value)
        self._norm_sum.add_(value)
        torch.maximum(self._norm_max, value, out=self._norm_max)
        self._norm_steps += 1

    def start_pass(self) -> None:
        """Forget the norms of a pass that did not end (a recovery redoes it): every rank
        that steps starts the pass at the same turn of ``grad_norm_every``."""
        self._norm_steps = self._norm_turn = 0
        if self._norm_sum is not None and self._norm_max is not None:
            self._norm_sum.zero_()
            self._norm_max.zero_()

    def carried_norms(self) -> list[Any]:
        """The pass's gradient norms so far, on the host, to go on from (a segment's end)."""
        return [
            None if self._norm_sum is None else self._norm_sum.to("cpu", copy=True),
            None if self._norm_max is None else self._norm_max.to("cpu", copy=True),
            self._norm_steps,
            self._norm_turn,
        ]

    def carry_norms_on(self, carried: list[Any]) -> None:
        """Go on from :meth:`carried_norms` (the same pass, after a recovery)."""
        total, largest, self._norm_steps, self._norm_turn = carried
        device = self.flat_device
        self._norm_sum = None if total is None else total.to(device, copy=True)
        self._norm_max = None if largest is None else largest.to(device, copy=True)

    def take_norms(self) -> tuple[float, float] | None:
        """The mean and the largest gradient norm of the steps since the last call (before
        clipping, of the averaged gradients), or ``None`` without a step measured; reads the
        device (a pass's end)."""
        steps, self._norm_steps, self._norm_turn = self._norm_steps, 0, 0
        if steps == 0 or self._norm_sum is None or self._norm_max is None:
            return None
        total, largest = self._norm_sum.item(), self._norm_max.item()
        self._norm_sum.zero_()
        self._norm_max.zero_()
        return total / steps, largest

    def skip(self) -> None:
        """Skip the step (its summed loss was not finite): zero the gradients."""
        self.flat.zero_gradients()

    def step(
        self,
        examples: float,
        *,
        epoch: int,
        step: int,
        averaged: bool = False,
        combine: Combine | None = None,
    ) -> bool:
        """Average the summed gradients over ``examples`` (with fp16 loss scaling, sums of
        shares of the nominal step: over ``LossScale.weight(examples)``) and step
        (``averaged``: the losses were weighted by their share of ``examples`` before
        backward, so the gradients are averages already); the caller has checked that the
        step's summed loss is finite.

        Returns whether the step's loss counts towards the pass's mean: a step without
        examples does not, one skipped for an fp16 overflow does.
        """
        try:
            if examples == 0:
                return False
            scale = self.loss_scale
            divisor = (1.0 if averaged else scale.weight(examples)) * scale.factor
            if not averaged:
                scale.note(examples)
            gradients = self.gradients()
            if divisor != 1.0 and gradients:
                torch._foreach_div_(gradients, divisor)
            if self.loss_scale.enabled and not self.loss_scale.update(gradients, combine):
                logger.info(
                    "epoch %d, step %d: fp16 gradients overflowed; skipping the step, "
                    "loss scale now %g",
                    epoch,
                    step,
                    self.loss_scale.scale,
                )
                return True
            self._clip(combine)
            self.optimizer.step()
            return True
        finally:
            self.flat.zero_gradients()
