"""The effect types: every side effect the drivers take, named once.

A suspended effect is an async callable. Calling it starts nothing until the result is
awaited, and it can be called again for the next epoch (a coroutine object could not).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

if TYPE_CHECKING:  # the loop imports these effect types: no import cycle at run time
    from .loop._state import LoopState, TrainingState

__all__ = [
    "Batch",
    "BatchSource",
    "CheckpointLoopState",
    "CheckpointState",
    "SaveBestModel",
    "TrainEpoch",
    "ValidationEpoch",
]

TrainEpoch: TypeAlias = Callable[[float], Awaitable[float]]
"""``async (lr_factor) -> mean training loss``: run one training pass at ``lr_factor`` times
the optimizer's base learning rate."""

ValidationEpoch: TypeAlias = Callable[[], Awaitable[float]]
"""``async () -> mean validation loss``: run one validation pass."""

SaveBestModel: TypeAlias = Callable[[], Awaitable[None]]
"""``async () -> None``: remember the current model as the best one so far."""

CheckpointLoopState: TypeAlias = Callable[["LoopState", Any], Awaitable[None]]
"""``async (loop_state, lr_state) -> None``: what the pure epoch driver checkpoints."""


class CheckpointState(Protocol):
    """``async (training_state, lr_state) -> None``, awaited by the root after every epoch.

    ``training_state.loop_state.epoch`` is the next epoch to run and ``lr_state`` the
    schedule state after this epoch's transition, so resuming from them continues exactly.
    ``lampdist.checkpoint.to_directory`` builds one that writes atomic checkpoints.
    """

    def __call__(self, training_state: TrainingState, lr_state: Any, /) -> Awaitable[None]: ...


Batch: TypeAlias = tuple[Any, Any]
"""``(inputs, target)``: inputs a tensor, or a tuple or dict of tensors; target a tensor."""

BatchSource: TypeAlias = Callable[[], Iterable[Batch] | AsyncIterable[Batch]]
"""A zero-argument factory called once per pass; it returns an iterable (a
``torch.utils.data.DataLoader`` works as it is) or an async iterable of batches."""
