"""The root's resume and checkpoint checks: a checkpoint's state dicts into its model and
optimizer, its schedule state and RNG states, before any rank trains; and whether a schedule
state survives being checkpointed.

State dicts are the original module's (see :func:`lampdist._model.original_module`), so a
checkpoint of a compiled run loads into an eager one and the reverse; keys a compiled module
wrote (``_orig_mod.0.weight``) load too. A state that does not fit the run's model or
optimizer is a :class:`CheckpointError` (rank 0, phase ``'resume'``) naming the checkpoint and
what differs, not torch's raw error.

A checkpoint resumed on another number of ranks (:func:`check_data_places`): the model,
optimizer and schedule resume exactly, but no rank's place in its data carries over, since
each rank's data is its own. Places that a replay or a :class:`~lampdist.RandomBatches`
state keeps give way to a new pass over the data on every rank (a warning says so); the
state of any other source (a ``StatefulDataLoader``'s, a ``datasets.IterableDataset``'s: how
far each rank got in its own shard) cannot be split over another number of ranks and is
refused with a :class:`ConfigError`, not dropped in silence.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from .._checkpoint import RngStates, restore_rng_states
from .._epoch import Stepper
from .._errors import CheckpointError, ConfigError
from .._model import original_module
from .._random_batches import is_random_state
from .._words import counted
from ..checkpoint import Resumed
from ..schedules import LearningRateSchedule, state_from_json, state_to_json

__all__ = [
    "check_data_places",
    "check_schedule_state",
    "fitting_model_state",
    "load_model_state",
    "load_optimizer_state",
    "restore_rng",
    "resumed_schedule_state",
]

COMPILED_PREFIX = "_orig_mod."
"""What ``torch.compile``'s wrapper puts before each key of the module it wraps."""

_SHOWN = 4
"""Differences named in an error; the rest are counted."""

_LOAD_ERRORS = (RuntimeError, ValueError, KeyError, TypeError, IndexError)
"""What torch's ``load_state_dict`` raises for a state that does not fit."""


def fitting_model_state(
    module: torch.nn.Module,
    state: Mapping[str, Any],
    *,
    path: Path | str | None,
    what: str = "model",
) -> Mapping[str, Any]:
    """``state`` (a checkpoint's ``what`` state dict) keyed as ``module``'s original module's
    state dict: the keys of a compiled module lose their ``_orig_mod.`` prefix.

    Raises :class:`CheckpointError` naming ``path`` and the first missing keys, unexpected
    keys and shape mismatches when ``state`` is not a state dict of this model.
    """
    target = original_module(module)
    expected = target.state_dict()
    state = _without_compiled_prefix(state, expected)
    parameters = {name for name, _ in target.named_parameters(remove_duplicate=False)}
    differences = []
    for name, value in expected.items():
        kind = "parameter" if name in parameters else "buffer"
        if name not in state:
            differences.append(f"{kind} {name!r}: in the model, not in the checkpoint")
            continue
        saved = state[name]
        tensors = isinstance(value, torch.Tensor) and isinstance(saved, torch.Tensor)
        if tensors and saved.shape != value.shape:
            differences.append(
                f"{kind} {name!r}: shape {tuple(saved.shape)} in the checkpoint, "
                f"{tuple(value.shape)} in the model"
            )
    for name, saved in state.items():
        if name not in expected:
            shape = f" (shape {tuple(saved.shape)})" if isinstance(saved, torch.Tensor) else ""
            differences.append(f"{name!r}{shape}: in the checkpoint, not in the model")
    if differences:
        shown = "; ".join(differences[:_SHOWN])
        more = f"; and {len(differences) - _SHOWN} more" if len(differences) > _SHOWN else ""
        raise _error(
            f"the {what} state in {_where(path)} does not fit this run's model "
            f"({type(target).__name__}): {shown}{more}",
            "model",
        )
    return state


def load_model_state(
    module: torch.nn.Module, state: Mapping[str, Any], *, path: Path | str | None
) -> None:
    """Load a checkpoint's model state dict into ``module``'s original module.

    Raises :class:`CheckpointError` naming ``path`` when it does not fit (see
    :func:`fitting_model_state`, and anything else ``load_state_dict`` refuses).
    """
    fitting = fitting_model_state(module, state, path=path)
    try:
        original_module(module).load_state_dict(fitting)
    except _LOAD_ERRORS as exc:
        raise _error(
            f"the model state in {_where(path)} does not load into this run's model "
            f"({type(exc).__name__}: {exc})",
            "model",
        ) from exc


def load_optimizer_state(
    stepper: Stepper, state: Mapping[str, Any], *, path: Path | str | None
) -> None:
    """Load a checkpoint's optimizer state dict into ``stepper`` (sharded: its slice).

    Raises :class:`CheckpointError` naming ``path`` when the state has other parameter groups
    than the run's optimizer, was written by an optimizer with other hyperparameters (its
    groups lack some of this optimizer's), or does not load.
    """
    whole = stepper.shard.template if stepper.shard is not None else stepper.optimizer
    name = type(whole).__name__
    groups = [len(group["params"]) for group in whole.param_groups]
    saved_groups = state.get("param_groups")
    saved = (
        [len(group.get("params", ())) for group in saved_groups if isinstance(group, Mapping)]
        if isinstance(saved_groups, list)
        else None
    )
    if saved != groups:
        held = "no parameter groups" if saved is None else f"parameter groups of {saved}"
        raise _error(
            f"the optimizer state in {_where(path)} does not fit this run's optimizer: "
            f"it holds {held} parameters, this run's {name} groups of {groups}",
            "optimizer",
        )
    before = [set(group) for group in stepper.optimizer.param_groups]
    try:
        stepper.load_state_dict(dict(state))
    except CheckpointError as exc:
        raise _error(f"the optimizer state in {_where(path)}: {exc.message}", "optimizer") from exc
    except _LOAD_ERRORS as exc:
        raise _error(
            f"the optimizer state in {_where(path)} does not load into this run's {name} "
            f"({type(exc).__name__}: {exc})",
            "optimizer",
        ) from exc
    after = [set(group) for group in stepper.optimizer.param_groups]
    lacking = sorted(set().union(*(b - a for b, a in zip(before, after, strict=True))))
    if lacking:
        raise _error(
            f"the optimizer state in {_where(path)} was written by another optimizer: its "
            f"parameter groups lack {', '.join(map(repr, lacking))}, which this run's {name} has",
            "optimizer",
        )


def _without_compiled_prefix(
    state: Mapping[str, Any], expected: Mapping[str, Any]
) -> Mapping[str, Any]:
    """``state`` without the ``_orig_mod.`` prefix on every key, when all its keys have it
    and the model's have not (a compiled module's state dict)."""
    stripped = state
    while (
        stripped
        and all(key.startswith(COMPILED_PREFIX) for key in stripped)
        and not any(key.startswith(COMPILED_PREFIX) for key in expected)
    ):
        renamed: OrderedDict[str, Any] = OrderedDict(stripped)
        metadata = getattr(stripped, "_metadata", None)
        if metadata is not None:  # torch's per-module versions ride on the state dict
            renamed._metadata = OrderedDict(metadata)  # type: ignore[attr-defined]  # torch's
        consume_prefix_in_state_dict_if_present(renamed, COMPILED_PREFIX)
        stripped = renamed
    return stripped


def resumed_schedule_state(schedule: LearningRateSchedule[Any], resume: Resumed | None) -> Any:
    """The schedule state to resume from, rebuilt against the run's own ``schedule``
    (``None``, the schedule's ``init``, for a new run). Raises :class:`CheckpointError`
    (phase ``'resume'``) when the stored state does not fit ``schedule``."""
    if resume is None:
        return None
    try:
        return state_from_json(schedule, resume.schedule_state)
    except ConfigError as exc:
        raise CheckpointError(
            f"the checkpoint's learning-rate schedule state does not fit this run's schedule: "
            f"{exc.message}",
            rank=0,
            phase="resume",
        ) from exc


def check_schedule_state(schedule: LearningRateSchedule[Any], state: Any, *, epoch: int) -> None:
    """Raise :class:`CheckpointError` unless ``state`` comes back from its JSON form as it is
    (a resumed run rebuilds it so), before it is checkpointed."""
    try:
        data = state_to_json(state)
        back = state_to_json(state_from_json(schedule, data))
    except ConfigError as exc:
        raise CheckpointError(
            f"epoch {epoch}: the learning-rate schedule state {state!r} cannot be checkpointed "
            f"and resumed: {exc.message}",
            rank=0,
            phase="checkpoint",
        ) from exc
    if back != data:
        raise CheckpointError(
            f"epoch {epoch}: the learning-rate schedule state {state!r} would resume as "
            f"{back!r}: give the state types that survive JSON (attrs or dataclass values of "
            "numbers, or plain JSON with finite floats)",
            rank=0,
            phase="checkpoint",
        )


def check_data_places(resume: Resumed | None, nranks: int) -> None:
    """Raise :class:`ConfigError` when ``resume`` was written by another number of ranks than
    ``nranks`` and its ranks' places in their data hold a training source's state other than
    :class:`~lampdist.RandomBatches`' (which cannot be split over other ranks)."""
    ranks = resume.training_state.rank_states if resume is not None else None
    if resume is None or ranks is None or len(ranks) == nranks:
        return
    states = [rank["position"]["state"] for rank in ranks if rank.get("position")]
    kept = [state for state in states if state is not None and not is_random_state(state)]
    if not kept:
        return
    raise ConfigError(
        f"resume: {_where(resume.path)} was written by {counted(len(ranks), 'rank')}, each "
        f"with its training source's state_dict() (a {type(kept[0]).__name__}: how far it "
        f"got in its own data), and this run has {nranks}: a source's state cannot be split "
        f"over another number of ranks. Resume on {len(ranks)} ranks, or start every rank's "
        "data afresh with resume=attrs.evolve(resumed, training_state=attrs.evolve("
        "resumed.training_state, rank_states=None)) (lampdist.RandomBatches' state gives way "
        "to a new pass on its own)",
        phase="resume",
    )


def restore_rng(states: RngStates) -> None:
    """Restore the global RNG states saved with a checkpoint (the root, before it resumes)."""
    restore_rng_states(states)


def _where(path: Path | str | None) -> str:
    return f"checkpoint {path}" if path is not None else "the checkpoint given as resume="


def _error(message: str, writer: str) -> CheckpointError:
    return CheckpointError(
        f"{message}: resume with the {writer} that wrote it, or start a new run in another "
        "directory",
        rank=0,
        phase="resume",
    )
