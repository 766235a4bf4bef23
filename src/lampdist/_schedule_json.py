"""A schedule state to JSON and back: the machinery of :func:`lampdist.schedules.state_to_json`
and :func:`lampdist.schedules.state_from_json`.

A state is rebuilt after the type of the schedule's initial state: the type annotations of
its fields, and for a field typed by a type variable (or ``Any``), the type of the initial
state's own value there.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from types import NoneType, UnionType
from typing import Any, TypeVar

import attrs

from ._errors import ConfigError

__all__ = ["structure", "to_json"]

_NON_FINITE = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def _fail(message: str) -> ConfigError:
    return ConfigError(message, phase="configure")


def to_json(state: object) -> object:
    """``state`` as plain JSON data (what :func:`lampdist.schedules.state_to_json` says)."""
    if state is None or isinstance(state, bool | int | str):
        return state
    if isinstance(state, float):
        if math.isfinite(state):
            return state
        return "NaN" if math.isnan(state) else ("Infinity" if state > 0 else "-Infinity")
    cls: Any = type(state)
    if attrs.has(cls):
        return {f.name: to_json(getattr(state, f.name)) for f in attrs.fields(cls)}
    if dataclasses.is_dataclass(state):
        return {f.name: to_json(getattr(state, f.name)) for f in dataclasses.fields(state)}
    if isinstance(state, dict) and all(isinstance(key, str) for key in state):
        return {key: to_json(value) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return [to_json(value) for value in state]
    raise _fail(
        f"a schedule state must be made of None, booleans, numbers, strings, lists, dicts and "
        f"attrs or dataclass values of those, got {state!r}"
    )


def _mismatch(schedule: object, data: object) -> ConfigError:
    return _fail(
        f"{data!r} is not a state of {schedule!r}; "
        "pass the learning-rate schedule the checkpoint was written with"
    )


def _fields(cls: type) -> list[tuple[str, str]]:
    """(stored name, constructor keyword) of each field an instance is built from."""
    if attrs.has(cls):
        return [(f.name, f.alias or f.name) for f in attrs.fields(cls) if f.init]
    return [(f.name, f.name) for f in dataclasses.fields(cls) if f.init]


def structure(cls: Any, template: object, data: object, schedule: object) -> object:
    """``data`` as a value of type ``cls``; ``template`` (the initial state's value at this
    place, or None) stands in for a type variable or ``Any``."""
    if isinstance(cls, TypeVar):  # a wrapped schedule's state: the template says its type
        cls = type(template)
    elif cls is Any or cls is object:
        if template is None:
            return data
        cls = type(template)
    if cls is NoneType or cls is None:
        if data is not None:
            raise _mismatch(schedule, data)
        return None
    if isinstance(cls, UnionType) or typing.get_origin(cls) is typing.Union:
        options = typing.get_args(cls)
        if data is None and NoneType in options:
            return None
        for option in options:
            if option is NoneType:
                continue
            try:
                return structure(option, template, data, schedule)
            except ConfigError:
                continue
        raise _mismatch(schedule, data)
    origin = typing.get_origin(cls)
    if origin is tuple or origin is list or cls in (tuple, list):
        if not isinstance(data, list):
            raise _mismatch(schedule, data)
        args = typing.get_args(cls)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(data):
                raise _mismatch(schedule, data)
            pairs = zip(args, data, strict=True)
            items = [structure(arg, None, item, schedule) for arg, item in pairs]
        else:
            item_type = args[0] if args else Any
            items = [structure(item_type, None, item, schedule) for item in data]
        return tuple(items) if (origin or cls) is tuple else items
    if origin is dict or cls is dict:
        if not isinstance(data, dict):
            raise _mismatch(schedule, data)
        args = typing.get_args(cls)
        value_type = args[1] if len(args) == 2 else Any
        return {key: structure(value_type, None, item, schedule) for key, item in data.items()}
    if cls is bool or cls is str:
        if not isinstance(data, cls):
            raise _mismatch(schedule, data)
        return data
    if cls is int:
        if not isinstance(data, int) or isinstance(data, bool):
            raise _mismatch(schedule, data)
        return data
    if cls is float:
        if isinstance(data, str) and data in _NON_FINITE:
            return _NON_FINITE[data]
        if not isinstance(data, int | float) or isinstance(data, bool):
            raise _mismatch(schedule, data)
        return float(data)
    if isinstance(cls, type) and (attrs.has(cls) or dataclasses.is_dataclass(cls)):
        hints = typing.get_type_hints(cls)
        fields = _fields(cls)
        if not isinstance(data, dict) or set(data) != {name for name, _ in fields}:
            raise _mismatch(schedule, data)
        values = {
            keyword: structure(
                hints.get(name, Any),
                getattr(template, name) if isinstance(template, cls) else None,
                data[name],
                schedule,
            )
            for name, keyword in fields
        }
        return cls(**values)
    raise _fail(
        f"cannot rebuild a schedule state of type {cls!r}; give a state the types None, bool, "
        "int, float, str, tuple, list, dict or attrs or dataclass classes of those"
    )
