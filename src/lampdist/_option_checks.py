"""The validators of the option classes: each refuses a value with a :class:`ConfigError`
(phase ``'configure'``) that names the class and the field."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeGuard

import attrs

from ._errors import ConfigError

__all__ = ["Validator", "is_int", "is_number", "optional", "positive", "validator", "validator_by"]

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def validator(rule: Callable[[Any], bool], wants: str, instead: str) -> Validator:
    """A validator that refuses a value for which ``rule`` is false with a
    :class:`ConfigError` (phase ``'configure'``): the field must be ``wants``; ``instead``
    says what to pass."""

    def validate(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not rule(value):
            raise ConfigError(
                f"{type(instance).__name__}.{attribute.name} must be {wants}, got {value!r}: "
                f"{instead}",
                phase="configure",
            )

    return validate


def validator_by(check: Callable[[object, str], None]) -> Validator:
    """A validator from a check that names the value it refuses (shared with
    :func:`lampdist.epochs`, which takes the same arguments)."""

    def validate(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        check(value, f"{type(instance).__name__}.{attribute.name}")

    return validate


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def positive(value: object) -> bool:
    """A number (not a bool) > 0; NaN is not."""
    return is_number(value) and value > 0


def optional(rule: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or rule(value)
