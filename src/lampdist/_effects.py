"""The effect types: every side effect the drivers take, named once.

A suspended effect is an async callable. Calling it starts nothing until the result is
awaited, and it can be called again for the next epoch (a coroutine object could not).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol, TypeAlias

import torch

from ._source import PassContext
from ._state import LoopState, PassEvent, Recovered, TrainingState

__all__ = [
    "Batch",
    "BatchSource",
    "CheckpointLoopState",
    "CheckpointState",
    "EpochOutcome",
    "OnEvent",
    "OnPassEvent",
    "OptimizerFactory",
    "PassAwareBatchSource",
    "SaveBestModel",
    "TrainEpoch",
    "ValidationEpoch",
]


EpochOutcome: TypeAlias = float | tuple[float, Mapping[str, float | tuple[float, ...]]]
"""What a pass effect returns: its mean loss, or ``(mean loss, metrics)`` with the pass's
metrics by name (floats, or tuples of floats for vector-valued ones)."""


class TrainEpoch(Protocol):
    """``async (lr_factor) -> mean training loss``: run one training pass at ``lr_factor``
    times the optimizer's base learning rate (or return ``(mean loss, metrics)``: the
    pass's metrics by name)."""

    def __call__(self, lr_factor: float, /) -> Awaitable[EpochOutcome]: ...


class ValidationEpoch(Protocol):
    """``async () -> mean validation loss``: run one validation pass (or return ``(mean
    loss, metrics)``: the pass's metrics by name)."""

    def __call__(self) -> Awaitable[EpochOutcome]: ...


class SaveBestModel(Protocol):
    """``async () -> None``: remember the current model as the best one so far."""

    def __call__(self) -> Awaitable[None]: ...


class CheckpointLoopState(Protocol):
    """``async (loop_state, lr_state) -> None``: what the pure epoch driver checkpoints."""

    def __call__(self, loop_state: LoopState, lr_state: Any, /) -> Awaitable[None]: ...


class CheckpointState(Protocol):
    """``async (training_state, lr_state) -> None``, awaited by the root after every epoch.

    ``training_state.loop_state.epoch`` is the next epoch to run and ``lr_state`` the
    schedule state after this epoch's transition, so resuming from them continues exactly.
    ``lampdist.checkpoint.to_directory`` builds one that writes atomic checkpoints.
    """

    def __call__(self, training_state: TrainingState, lr_state: Any, /) -> Awaitable[None]: ...


Batch: TypeAlias = tuple[Any, Any]
"""``(inputs, target)``: inputs a tensor, or a tuple or dict of tensors; target a tensor."""


class BatchSource(Protocol):
    """A zero-argument factory called once per pass; it returns an iterable (a
    ``torch.utils.data.DataLoader`` works as it is) or an async iterable of batches.

    ``lambda: loader`` is a batch source for a ``DataLoader`` named ``loader``. A source that
    shuffles should be a :class:`PassAwareBatchSource` instead, so that its order is exact."""

    def __call__(self) -> Iterable[Batch] | AsyncIterable[Batch]: ...


class PassAwareBatchSource(Protocol):
    """A batch source that takes the pass's :class:`~lampdist.PassContext` (epoch, kind,
    rank, a seed of its own): ``lambda context: DataLoader(dataset, shuffle=True,
    generator=context.generator())`` shuffles in the same order in every run."""

    def __call__(self, context: PassContext, /) -> Iterable[Batch] | AsyncIterable[Batch]: ...


class OnPassEvent(Protocol):
    """``async (event) -> None``: the root's progress effect, called on its event loop with
    each pass's :class:`~lampdist.PassEvent`, and with each in-job recovery's
    :class:`~lampdist.Recovered` (an effect of ``event: PassEvent | Recovered`` tells them
    apart with ``isinstance``; one typed for a ``PassEvent`` alone still gets a recovery,
    which answers a PassEvent's fields with a ``DeprecationWarning``); a pass's steps never
    wait for it."""

    def __call__(self, event: PassEvent, /) -> Awaitable[None]: ...


OnEvent = Callable[[PassEvent | Recovered], Awaitable[None]]
"""How lampdist calls an :class:`OnPassEvent` with either event."""


class OptimizerFactory(Protocol):
    """``(parameters) -> optimizer``: builds the optimizer over the model's parameters (on the
    rank's compute thread)."""

    def __call__(self, parameters: Iterable[torch.nn.Parameter], /) -> torch.optim.Optimizer: ...
