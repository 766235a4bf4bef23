"""The schedules without state of :mod:`lampdist.schedules`: an epoch's factor from the epoch
alone (their state is ``None``), and a step's factor from the global step alone.

The classes keep their underscored names: their reprs name them (the ranks compare what a
``StepOptions.learning_rate_per_step`` gives, not its repr, since plain callables are step
schedules too).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs

__all__ = [
    "_Cosine",
    "_Cyclic",
    "_Decrement",
    "_FromEpochCount",
    "_Linear",
    "_Noop",
    "_StepAfter",
    "_WarmupDecaySteps",
]


def _clamp(value: float, a: float, b: float) -> float:
    return min(max(value, min(a, b)), max(a, b))


class _Stateless:
    """A schedule whose factor depends on the epoch alone; its state is ``None``."""

    @property
    def init(self) -> None:
        return None


@attrs.frozen
class _FromEpochCount(_Stateless):
    f: Callable[[int], float]

    def learning_rate_factor(
        self, state: None, epoch: int, last_validation_loss: float | None
    ) -> tuple[None, float]:
        return None, float(self.f(epoch))


@attrs.frozen
class _Noop(_Stateless):
    def learning_rate_factor(
        self, state: None, epoch: int, last_validation_loss: float | None
    ) -> tuple[None, float]:
        return None, 1.0


@attrs.frozen(kw_only=True)
class _Decrement(_Stateless):
    every: int
    factor: float

    def learning_rate_factor(
        self, state: None, epoch: int, last_validation_loss: float | None
    ) -> tuple[None, float]:
        return None, float(self.factor ** (epoch // self.every))


@attrs.frozen(kw_only=True)
class _StepAfter(_Stateless):
    steps: int
    factor: float

    def learning_rate_factor(
        self, state: None, epoch: int, last_validation_loss: float | None
    ) -> tuple[None, float]:
        return None, float(self.factor) if epoch > self.steps else 1.0


@attrs.frozen(kw_only=True)
class _Linear(_Stateless):
    start: float
    end: float
    max_steps: int

    def learning_rate_factor(
        self, state: None, epoch: int, last_validation_loss: float | None
    ) -> tuple[None, float]:
        if epoch >= self.max_steps:
            return None, float(self.end)
        value = self.start + (self.end - self.start) * (epoch / self.max_steps)
        return None, _clamp(value, self.start, self.end)


@attrs.frozen(kw_only=True)
class _Cyclic(_Stateless):
    max_factor: float
    period: int

    def learning_rate_factor(
        self, state: None, epoch: int, last_validation_loss: float | None
    ) -> tuple[None, float]:
        phase = epoch % self.period
        # Integer distance from the peak keeps phase and period - phase exactly symmetric.
        rise = 1.0 - abs(2 * phase - self.period) / self.period
        value = self.max_factor if rise == 1.0 else 1.0 + (self.max_factor - 1.0) * rise
        return None, _clamp(value, 1.0, self.max_factor)


@attrs.frozen(kw_only=True)
class _Cosine(_Stateless):
    max_steps: int
    min_factor: float

    def learning_rate_factor(
        self, state: None, epoch: int, last_validation_loss: float | None
    ) -> tuple[None, float]:
        if epoch >= self.max_steps:
            return None, float(self.min_factor)
        half = (1.0 + math.cos(math.pi * epoch / self.max_steps)) / 2.0
        value = self.min_factor + (1.0 - self.min_factor) * half
        return None, _clamp(value, self.min_factor, 1.0)


@attrs.frozen(kw_only=True)
class _WarmupDecaySteps:
    warmup_steps: int
    total_steps: int
    final_factor: float
    shape: str

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if step >= self.total_steps:
            return self.final_factor
        progress = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        if self.shape == "cosine":
            half = (1.0 + math.cos(math.pi * progress)) / 2.0
            return self.final_factor + (1.0 - self.final_factor) * half
        return 1.0 + (self.final_factor - 1.0) * progress
