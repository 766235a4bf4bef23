"""The argument checks of :mod:`lampdist.schedules`' factories: each refuses a value with a
:class:`~lampdist.ConfigError` (phase ``'configure'``) that names the argument."""

from __future__ import annotations

import math

from ._errors import ConfigError

__all__ = ["check_float", "check_int", "fail"]


def fail(message: str) -> ConfigError:
    return ConfigError(message, phase="configure")


def check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise fail(f"{name} must be an int >= {minimum}, got {value!r}; pass a whole number")


def check_float(
    name: str, value: object, *, low: float, high: float = math.inf, open_low: bool = False
) -> None:
    ok = (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value > low if open_low else value >= low)
        and value <= high
    )
    if not ok:
        bounds = f"{'(' if open_low else '['}{low}, {high}{']' if math.isfinite(high) else ')'}"
        raise fail(f"{name} must be a finite number in {bounds}, got {value!r}")
