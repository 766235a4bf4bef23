"""The command protocol's work in one place: what a command has every rank do.

The root sends a command and carries it out itself (:func:`order`); a follower carries out
the command it receives (:func:`carry_out`). Both go through :data:`WORK`, the one table from
a command's kind to its phase and its pass-runner call, so that the two halves cannot drift
apart. HOLD and REJOIN are not in it: they change the clique, not the model (see
``_generations`` and the follower).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import attrs

from .._checkpoint import ShardedState
from .._epoch import PassRunner
from .._errors import Phase
from .._options import ModelWithData
from ..control import Command, CommandKind, RootChannel
from ._failures import PhaseTracker

__all__ = ["WORK", "Work", "carry_out", "order"]


@attrs.frozen
class Work:
    """What one kind of command has every rank do: ``carry(runner, data, command, shards)``
    in ``phase``."""

    phase: Phase
    carry: Callable[[PassRunner, ModelWithData, Command, ShardedState | None], Awaitable[Any]]


async def _train(
    runner: PassRunner, data: ModelWithData, command: Command, shards: ShardedState | None
) -> Any:
    return await runner.train_pass(
        data.train_batches,
        epoch=command.epoch,
        pass_index=command.pass_index,
        lr_factor=command.lr_factor if command.lr_factor is not None else 1.0,
    )


async def _valid(
    runner: PassRunner, data: ModelWithData, command: Command, shards: ShardedState | None
) -> Any:
    assert data.validation_batches is not None  # the agreement check ensures it
    return await runner.validation_pass(
        data.validation_batches, epoch=command.epoch, pass_index=command.pass_index
    )


async def _checkpoint(
    runner: PassRunner, data: ModelWithData, command: Command, shards: ShardedState | None
) -> Any:
    return await runner.checkpoint_parts(shards)


async def _stop(
    runner: PassRunner, data: ModelWithData, command: Command, shards: ShardedState | None
) -> Any:
    return await runner.sync_parameters()  # every rank takes the root's final (or best) model


WORK: dict[CommandKind, Work] = {
    CommandKind.TRAIN: Work("train", _train),
    CommandKind.VALID: Work("valid", _valid),
    CommandKind.CHECKPOINT: Work("checkpoint", _checkpoint),
    CommandKind.STOP: Work("stop", _stop),
}
"""Each command kind's work (a STOP with an ``error`` aborts instead: no work)."""


async def carry_out(
    runner: PassRunner,
    data: ModelWithData,
    command: Command,
    tracker: PhaseTracker,
    shards: ShardedState | None = None,
) -> Any:
    """Carry ``command`` out on this rank, in its phase; what the runner returns (on the
    root, the pass's result or the checkpoint's parts)."""
    work = WORK[command.kind]
    tracker.current = work.phase
    return await work.carry(runner, data, command, shards)


async def order(
    control: RootChannel,
    runner: PassRunner,
    data: ModelWithData,
    command: Command,
    tracker: PhaseTracker,
    shards: ShardedState | None = None,
) -> Any:
    """The root's side: send ``command`` to every follower, then carry it out with them
    (``shards``: where the ranks write their shards of a CHECKPOINT, fsdp)."""
    tracker.current = WORK[command.kind].phase
    await control.broadcast(command)
    return await carry_out(runner, data, command, tracker, shards)
