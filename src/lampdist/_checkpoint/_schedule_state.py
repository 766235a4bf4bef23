"""The learning-rate schedule state as JSON, and its typed rebuild from a schedule.

A schedule's state is a frozen attrs value made of numbers (possibly nested attrs values),
or a plain number or ``None``. It is stored as ``attrs.asdict`` JSON together with its type
name; loading gives the plain dict (or number) back, or, given the schedule, an instance of
``type(schedule.init)`` rebuilt field by field.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any

import attrs

from .._errors import CheckpointError

__all__ = ["rebuild_schedule_state", "schedule_state_from_json", "schedule_state_to_json"]


def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def schedule_state_to_json(state: Any) -> dict[str, Any]:
    """``{"type": ..., "value": ...}`` for a schedule state; raises CheckpointError if it is
    not made of numbers."""
    value = attrs.asdict(state, recurse=True) if attrs.has(type(state)) else state
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"cannot checkpoint the learning-rate schedule state {state!r}: a schedule state "
            f"must be an attrs value of numbers, a number or None ({exc})",
            phase="checkpoint",
        ) from exc
    return {"type": _type_name(type(state)), "value": value}


def schedule_state_from_json(data: dict[str, Any]) -> Any:
    """The stored plain value: a dict for an attrs state, else the number or None."""
    return data["value"]


def rebuild_schedule_state(init: Any, data: dict[str, Any]) -> Any:
    """An instance of ``type(init)`` rebuilt from stored JSON.

    Raises CheckpointError when the stored state was of another type or does not fit it.
    """
    cls = type(init)
    stored, value = data["type"], data["value"]
    if attrs.has(cls) and stored != _type_name(cls):
        raise CheckpointError(
            f"the checkpoint holds a {stored} schedule state but the schedule's initial state "
            f"is a {_type_name(cls)}: pass the schedule the run was checkpointed with",
            phase="resume",
        )
    try:
        return _rebuild(cls, value)
    except (TypeError, ValueError, KeyError, NameError) as exc:
        raise CheckpointError(
            f"the checkpointed schedule state {value!r} does not fit {_type_name(cls)} "
            f"({exc}): pass the schedule the run was checkpointed with",
            phase="resume",
        ) from exc


def _rebuild(cls: Any, value: Any) -> Any:
    if not (attrs.has(cls) and isinstance(value, dict)):
        if isinstance(value, list) and typing.get_origin(cls) is tuple:
            return tuple(value)
        return value
    hints = typing.get_type_hints(cls)
    kwargs = {
        field.alias: _rebuild_hinted(hints.get(field.name, Any), value[field.name])
        for field in attrs.fields(cls)
        if field.init and field.name in value
    }
    return cls(**kwargs)


def _rebuild_hinted(hint: Any, value: Any) -> Any:
    """Rebuild ``value`` for a field annotated ``hint`` (a class, ``X | None``, ``tuple``)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        candidates = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if isinstance(value, dict):
            candidates = [arg for arg in candidates if attrs.has(arg)]
        return _rebuild(candidates[0], value) if len(candidates) == 1 else value
    return _rebuild(hint, value)
