"""Step schedules that give, bit for bit, the factors of the libraries users come from:
transformers' ``get_*_schedule_with_warmup`` and ``get_wsd_schedule``, and torchtitan's
warm-up, stable and decay schedule. Re-exported by :mod:`lampdist.schedules`.

Each factor is computed with the very operations of the library's own lambda, in the same
order, so ``base_lr * factor`` is the learning rate ``LambdaLR`` sets there (the tests compare
them at every step).
"""

from __future__ import annotations

import math
from typing import Literal

import attrs

from ._schedule_checks import check_float, check_int, fail
from ._step_schedules import StepSchedule

__all__ = [
    "torchtitan_warmup_stable_decay",
    "transformers_constant_with_warmup",
    "transformers_cosine_with_warmup",
    "transformers_linear_with_warmup",
    "transformers_wsd",
]

Shape = Literal["linear", "cosine", "1-sqrt"]
TitanDecay = Literal["linear", "sqrt", "cosine"]


def _warmup(step: int, warmup: int) -> float:
    """transformers' warm-up: ``float(step) / float(max(1, warmup))``."""
    return float(step) / float(max(1, warmup))


@attrs.frozen(kw_only=True)
class _TransformersLinear:
    num_warmup_steps: int
    num_training_steps: int

    def factor(self, step: int) -> float:
        w, n = self.num_warmup_steps, self.num_training_steps
        if step < w:
            return _warmup(step, w)
        return max(0.0, float(n - step) / float(max(1, n - w)))


@attrs.frozen(kw_only=True)
class _TransformersCosine:
    num_warmup_steps: int
    num_training_steps: int
    num_cycles: float

    def factor(self, step: int) -> float:
        w, n = self.num_warmup_steps, self.num_training_steps
        if step < w:
            return _warmup(step, w)
        progress = float(step - w) / float(max(1, n - w))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(self.num_cycles) * 2.0 * progress)))


@attrs.frozen(kw_only=True)
class _TransformersConstant:
    num_warmup_steps: int

    def factor(self, step: int) -> float:
        if step < self.num_warmup_steps:
            return float(step) / float(max(1.0, self.num_warmup_steps))
        return 1.0


@attrs.frozen(kw_only=True)
class _TransformersWsd:
    num_warmup_steps: int
    num_stable_steps: int
    num_decay_steps: int
    warmup_type: Shape
    decay_type: Shape
    min_lr_ratio: float
    num_cycles: float

    def factor(self, step: int) -> float:
        w, s, d = self.num_warmup_steps, self.num_stable_steps, self.num_decay_steps
        low = self.min_lr_ratio
        if step < w:
            progress = float(step) / float(max(1, w))
            if self.warmup_type == "linear":
                factor = progress
            elif self.warmup_type == "cosine":
                factor = 0.5 * (1.0 - math.cos(math.pi * progress))
            else:
                factor = 1.0 - math.sqrt(1.0 - progress)
            return max(0.0, factor * (1.0 - low) + low)
        if step < w + s:
            return 1.0
        if step < w + s + d:
            progress = float(step - w - s) / float(max(1, d))
            if self.decay_type == "linear":
                factor = 1.0 - progress
            elif self.decay_type == "cosine":
                factor = 0.5 * (1.0 + math.cos(math.pi * float(self.num_cycles) * 2.0 * progress))
            else:
                factor = 1.0 - math.sqrt(progress)
            return max(0.0, factor * (1.0 - low) + low)
        return low


@attrs.frozen(kw_only=True)
class _TorchtitanWsd:
    warmup_steps: int
    stable_steps: int
    decay_steps: int
    training_steps: int
    decay_type: TitanDecay
    min_lr_factor: float
    legacy: bool

    def factor(self, step: int) -> float:
        step = min(step, self.training_steps)  # torchtitan trains no further: held there
        warmup_stable = self.warmup_steps + self.stable_steps
        if step < self.warmup_steps:
            if self.legacy:
                return float((step + 1) / (self.warmup_steps + 1))
            return float((step + 1) / self.warmup_steps)
        if step < warmup_stable:
            return 1.0
        if self.legacy:
            progress = float((step + 1) - warmup_stable) / (self.decay_steps + 1)
        else:
            progress = float((step + 1) - warmup_stable) / self.decay_steps
        if self.decay_type == "linear":
            adjustment = 1 - progress
        elif self.decay_type == "sqrt":
            adjustment = 1 - math.sqrt(progress)
        else:
            adjustment = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_factor + (1 - self.min_lr_factor) * adjustment


def _check_steps(**values: int) -> None:
    for name, value in values.items():
        check_int(name, value, 0)


def transformers_linear_with_warmup(num_warmup_steps: int, num_training_steps: int) -> StepSchedule:
    """transformers' ``get_linear_schedule_with_warmup``, bit for bit: the factor of step
    ``s`` (from 0) with ``W = num_warmup_steps`` and ``N = num_training_steps`` is::

        s / max(1, W)                        if s < W
        max(0, (N - s) / max(1, N - W))      otherwise

    so it is 0 at step 0, 1 at step ``W`` and falls to 0 at step ``N``, held at 0 after.
    Raises :class:`~lampdist.ConfigError` unless both are ints >= 0.
    """
    _check_steps(num_warmup_steps=num_warmup_steps, num_training_steps=num_training_steps)
    return _TransformersLinear(
        num_warmup_steps=num_warmup_steps, num_training_steps=num_training_steps
    )


def transformers_cosine_with_warmup(
    num_warmup_steps: int, num_training_steps: int, num_cycles: float = 0.5
) -> StepSchedule:
    """transformers' ``get_cosine_schedule_with_warmup``, bit for bit: the factor of step
    ``s`` with ``W = num_warmup_steps``, ``N = num_training_steps`` and ``c = num_cycles`` is::

        s / max(1, W)                                   if s < W
        max(0, (1 + cos(pi * c * 2 * p)) / 2)           otherwise, p = (s - W) / max(1, N - W)

    the default ``c = 0.5`` is a half-cosine from 1 at step ``W`` to 0 at step ``N``; after
    ``N`` the cosine goes on (as transformers' does). Raises :class:`~lampdist.ConfigError`
    unless the steps are ints >= 0 and ``num_cycles`` is a finite number >= 0.
    """
    _check_steps(num_warmup_steps=num_warmup_steps, num_training_steps=num_training_steps)
    check_float("num_cycles", num_cycles, low=0.0)
    return _TransformersCosine(
        num_warmup_steps=num_warmup_steps,
        num_training_steps=num_training_steps,
        num_cycles=float(num_cycles),
    )


def transformers_constant_with_warmup(num_warmup_steps: int) -> StepSchedule:
    """transformers' ``get_constant_schedule_with_warmup``, bit for bit: the factor of step
    ``s`` is ``s / max(1, num_warmup_steps)`` during the warm-up, then 1. Raises
    :class:`~lampdist.ConfigError` unless ``num_warmup_steps`` is an int >= 0."""
    _check_steps(num_warmup_steps=num_warmup_steps)
    return _TransformersConstant(num_warmup_steps=num_warmup_steps)


def transformers_wsd(
    num_warmup_steps: int,
    num_decay_steps: int,
    num_training_steps: int | None = None,
    num_stable_steps: int | None = None,
    warmup_type: Shape = "linear",
    decay_type: Shape = "cosine",
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
) -> StepSchedule:
    """transformers' ``get_wsd_schedule`` (warm-up, stable, decay), bit for bit. With
    ``W = num_warmup_steps``, ``S = num_stable_steps`` (default ``num_training_steps - W - D``),
    ``D = num_decay_steps``, ``m = min_lr_ratio`` and ``c = num_cycles``, the factor of step
    ``s`` is::

        max(0, w(s / max(1, W)) * (1 - m) + m)              if s < W
        1                                                   if s < W + S
        max(0, d((s - W - S) / max(1, D)) * (1 - m) + m)    if s < W + S + D
        m                                                   after

    where the warm-up ``w(p)`` is ``p`` (``"linear"``), ``(1 - cos(pi p)) / 2``
    (``"cosine"``) or ``1 - sqrt(1 - p)`` (``"1-sqrt"``), and the decay ``d(p)`` is ``1 - p``,
    ``(1 + cos(pi * c * 2 * p)) / 2`` or ``1 - sqrt(p)``.

    Raises :class:`~lampdist.ConfigError` unless exactly one of ``num_training_steps`` and
    ``num_stable_steps`` is given (transformers warns and takes ``num_stable_steps`` when both
    are), the steps are ints >= 0 with ``S >= 0``, the types are ``"linear"``, ``"cosine"`` or
    ``"1-sqrt"``, ``0 <= min_lr_ratio <= 1`` and ``num_cycles >= 0``.
    """
    _check_steps(num_warmup_steps=num_warmup_steps, num_decay_steps=num_decay_steps)
    if (num_training_steps is None) == (num_stable_steps is None):
        raise fail(
            "transformers_wsd needs exactly one of num_training_steps and num_stable_steps, got "
            f"num_training_steps={num_training_steps!r} and num_stable_steps={num_stable_steps!r}"
            "; pass num_training_steps (the stable phase is what the others leave)"
        )
    if num_stable_steps is None:
        check_int("num_training_steps", num_training_steps, num_warmup_steps + num_decay_steps)
        assert num_training_steps is not None  # exactly one is given
        num_stable_steps = num_training_steps - num_warmup_steps - num_decay_steps
    check_int("num_stable_steps", num_stable_steps, 0)
    for name, kind in (("warmup_type", warmup_type), ("decay_type", decay_type)):
        if kind not in ("linear", "cosine", "1-sqrt"):
            raise fail(f"{name} must be 'linear', 'cosine' or '1-sqrt', got {kind!r}")
    check_float("min_lr_ratio", min_lr_ratio, low=0.0, high=1.0)
    check_float("num_cycles", num_cycles, low=0.0)
    return _TransformersWsd(
        num_warmup_steps=num_warmup_steps,
        num_stable_steps=num_stable_steps,
        num_decay_steps=num_decay_steps,
        warmup_type=warmup_type,
        decay_type=decay_type,
        min_lr_ratio=float(min_lr_ratio),
        num_cycles=float(num_cycles),
    )


def torchtitan_warmup_stable_decay(
    warmup_steps: int,
    training_steps: int,
    *,
    decay_ratio: float | None = None,
    decay_type: TitanDecay = "linear",
    min_lr_factor: float = 0.0,
    legacy: bool = False,
) -> StepSchedule:
    """torchtitan's ``lr_scheduler`` (``LRSchedulersContainer``'s warm-up, stable, decay),
    bit for bit, given its settings (``lr_scheduler.warmup_steps``, ``training.steps`` or
    ``lr_scheduler.total_steps``, ``decay_ratio``, ``decay_type``, ``min_lr_factor``).

    With ``W = warmup_steps``, ``T = training_steps``, ``D = round(T * decay_ratio)`` (``T - W``
    without a ratio; cut to ``T - W`` where ``W + D > T``, as torchtitan does), ``m =
    min_lr_factor`` and ``S`` the stable steps, the factor of step ``s`` is::

        (s + 1) / W                               if s < W
        1                                         if s < W + S
        m + (1 - m) * d(p)                        otherwise, p = (s + 1 - W - S) / D

    with ``S = T + 1 - W - D`` (torchtitan since v0.1.0, June 2025: a virtual last step keeps
    step ``T - 1`` above ``m``). ``legacy=True`` gives the formula before that (commit
    e7c0cae, torchtitan#1284): ``(s + 1) / (W + 1)`` during the warm-up, ``S = T - W - D`` and
    ``p = (s + 1 - W - S) / (D + 1)``. The decay ``d(p)`` is ``1 - p`` (``"linear"``),
    ``1 - sqrt(p)`` (``"sqrt"``) or ``(1 + cos(pi p)) / 2`` (``"cosine"``). Steps after ``T``
    keep the factor of step ``T`` (``m``), where torchtitan stops training.

    Raises :class:`~lampdist.ConfigError` unless ``0 <= W <= T`` are ints (torchtitan cuts a
    longer warm-up to ``T``: pass ``T``), ``decay_ratio`` is ``None`` or in [0, 1],
    ``decay_type`` is ``"linear"``, ``"sqrt"`` or ``"cosine"`` and ``0 <= min_lr_factor <= 1``.
    """
    check_int("training_steps", training_steps, 1)
    check_int("warmup_steps", warmup_steps, 0)
    if warmup_steps > training_steps:
        raise fail(
            f"warmup_steps must be at most training_steps ({training_steps}), got "
            f"{warmup_steps}; pass warmup_steps={training_steps} (what torchtitan uses then)"
        )
    if decay_ratio is None:
        decay_steps = training_steps - warmup_steps
    else:
        check_float("decay_ratio", decay_ratio, low=0.0, high=1.0)
        decay_steps = min(round(training_steps * decay_ratio), training_steps - warmup_steps)
    if decay_type not in ("linear", "sqrt", "cosine"):
        raise fail(f"decay_type must be 'linear', 'sqrt' or 'cosine', got {decay_type!r}")
    check_float("min_lr_factor", min_lr_factor, low=0.0, high=1.0)
    stable = training_steps - warmup_steps - decay_steps + (0 if legacy else 1)
    return _TorchtitanWsd(
        warmup_steps=warmup_steps,
        stable_steps=stable,
        decay_steps=decay_steps,
        training_steps=training_steps,
        decay_type=decay_type,
        min_lr_factor=float(min_lr_factor),
        legacy=bool(legacy),
    )
