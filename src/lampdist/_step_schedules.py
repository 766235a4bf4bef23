"""Step schedules given as plain callables, rate schedules, and what the ranks agree on of a
step schedule: the values it gives, not its ``repr``.

A step schedule is an object with ``factor(step) -> float`` (a factor of each param group's
base learning rate) or ``rate(step)`` (the learning rate itself: one float for every param
group, or one per param group). ``StepOptions.learning_rate_per_step`` turns a plain callable
into :class:`_FactorSteps` (:func:`as_step_schedule`); :func:`lampdist.schedules.rate` makes a
:class:`_RateSteps`.

The ranks compare :func:`agreed_values` of their schedules when they join: the values at every
step below :func:`dense_steps` and at a geometric spread of later steps, as a digest, so two
processes with the same lambda agree and two with different ones are told apart.
"""

from __future__ import annotations

import hashlib
import numbers
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs

__all__ = [
    "SPREAD_DOUBLINGS",
    "SPREAD_PER_DOUBLING",
    "RateSchedule",
    "StepSchedule",
    "_FactorSteps",
    "_RateSteps",
    "agreed_values",
    "agreement_steps",
    "as_step_schedule",
    "dense_steps",
    "is_step_schedule",
]

DENSE_MIN = 1024
"""Every step below at least this many is compared (more with a longer window)."""
DENSE_MAX = 65536
"""... and below at most this many, however long the window."""
SPREAD_PER_DOUBLING = 32
"""Steps compared per doubling of the step after the dense ones."""
SPREAD_DOUBLINGS = 20
"""Doublings the spread covers: up to about a million times the dense steps."""
_SHOWN = 4
"""Values written out in full in the agreed description (the rest go into the digest)."""


class StepSchedule(Protocol):
    """A learning-rate factor for each optimizer step, from the run's global step (counted
    from 0 over the whole run: with ``StepOptions.steps_per_epoch=N``, step ``i`` of epoch
    ``e`` is ``e * N + i``). Every stepping rank evaluates it on the host before each step,
    so it must be a pure function of the step. A plain function ``step -> factor`` (a lambda
    too) is one as well: ``StepOptions`` wraps it. The ranks agree on a step schedule by the
    values it gives (at every step of the first window, at least the first 1024, and a spread
    of later steps), not by its ``repr``; nothing of it is checkpointed (the global step
    resumes with the epoch)."""

    def factor(self, step: int) -> float:
        """The factor for global step ``step`` (>= 0)."""
        ...


class RateSchedule(Protocol):
    """A learning rate for each optimizer step (what :func:`rate` makes), from the run's
    global step: one float that every param group takes, or a sequence of one float per
    param group, in the optimizer's order."""

    def rate(self, step: int) -> float | Sequence[float]:
        """The learning rate for global step ``step`` (>= 0)."""
        ...


@attrs.frozen
class _FactorSteps:
    """A plain callable ``step -> factor`` as a step schedule."""

    fn: Callable[[int], float]

    def factor(self, step: int) -> float:
        return float(self.fn(step))


@attrs.frozen
class _RateSteps:
    """A callable ``step -> learning rate`` (one float, or one per param group)."""

    fn: Callable[[int], float | Sequence[float]]

    def rate(self, step: int) -> float | Sequence[float]:
        return self.fn(step)


def is_step_schedule(value: object) -> bool:
    """Whether ``value`` is a step schedule: it has a callable ``factor`` or ``rate``."""
    return callable(getattr(value, "factor", None)) or callable(getattr(value, "rate", None))


def as_step_schedule(value: object) -> object:
    """``value`` as a step schedule: a plain callable (a lambda, a function) becomes
    :class:`_FactorSteps`; a step schedule, ``None`` and anything else stay as they are (the
    validator refuses what is no schedule)."""
    if value is None or is_step_schedule(value) or not callable(value):
        return value
    return _FactorSteps(value)


def dense_steps(window: int) -> int:
    """How many first steps the agreement compares, every one: the first window at least."""
    return min(max(window, DENSE_MIN), DENSE_MAX)


def agreement_steps(window: int) -> list[int]:
    """The global steps whose values the ranks compare: every step below
    :func:`dense_steps`, then :data:`SPREAD_PER_DOUBLING` steps per doubling for
    :data:`SPREAD_DOUBLINGS` doublings (the same list on every rank)."""
    dense = dense_steps(window)
    spread = {
        int(dense * 2 ** (k / SPREAD_PER_DOUBLING))
        for k in range(1, SPREAD_PER_DOUBLING * SPREAD_DOUBLINGS + 1)
    }
    return [*range(dense), *sorted(step for step in spread if step >= dense)]


def _value(value: object) -> str:
    """One value of a schedule, exactly (a float's hex digits)."""
    if isinstance(value, numbers.Real):
        return float(value).hex()
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return "(" + ", ".join(_value(item) for item in value) + ")"
    return f"<{type(value).__name__}>"


def _shown(value: object) -> str:
    """One value of a schedule, readable."""
    if isinstance(value, numbers.Real):
        return repr(float(value))
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return "(" + ", ".join(_shown(item) for item in value) + ")"
    return f"<{type(value).__name__}>"


def agreed_values(schedule: Any, window: int) -> str:
    """What the ranks compare of a step schedule with windows of ``window`` steps: its kind
    (factors or rates), its first values, and a digest of its values at
    :func:`agreement_steps` (a step at which it raises counts as the exception's type)."""
    rate = getattr(schedule, "rate", None)
    kind, give = ("rates", rate) if callable(rate) else ("factors", schedule.factor)
    digest = hashlib.sha256()
    shown: list[str] = []
    steps = agreement_steps(window)
    for step in steps:
        try:
            value: object = give(step)
        except Exception as exc:  # the same on every rank whose schedule is the same
            exact = readable = f"raises {type(exc).__name__}"
        else:
            exact, readable = _value(value), _shown(value)
        digest.update(f"{step}:{exact};".encode())
        if len(shown) < _SHOWN:
            shown.append(readable)
    return (
        f"{kind} {', '.join(shown)}, ... (sha256 {digest.hexdigest()[:16]} of the values at "
        f"every step below {dense_steps(window)} and {len(steps) - dense_steps(window)} later "
        f"steps up to {steps[-1]})"
    )
