"""The command protocol's work in one place: what a command has every rank do.

The root sends a command and carries it out itself (:func:`order`); a follower carries out
the command it receives (:func:`carry_out`). Both go through :data:`WORK`, the one table from
a command's kind to its phase and its pass-runner call, so that the two halves cannot drift
apart. HOLD and REJOIN are not in it: they change the clique, not the model (see
``_generations`` and the follower).
"""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable
from typing import Any

import attrs

from .._checkpoint import ShardedState
from .._epoch import PassResult, PassRunner
from .._errors import Phase
from .._options import ModelWithData
from ..control import Command, CommandKind, RootChannel
from ._failures import PhaseTracker

__all__ = ["EVALUATED", "WORK", "Work", "carry_out", "order"]

EVALUATED: contextvars.ContextVar[dict[str | None, PassResult] | None] = contextvars.ContextVar(
    "lampdist_evaluated", default=None
)
"""Where an evaluation-only run (:func:`lampdist.evaluate`) collects, on every rank, the
results the root shares (VALID with ``share_result``), by set; ``None`` outside one."""


def record_evaluated(name: str | None, result: PassResult) -> None:
    """Keep a shared validation result for the evaluation around this task, if any."""
    collected = EVALUATED.get()
    if collected is not None:
        collected[name] = result


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
        segment=command.segment,
    )


async def _valid(
    runner: PassRunner, data: ModelWithData, command: Command, shards: ShardedState | None
) -> Any:
    name = command.validation_set  # every rank has the root's sets: the agreement checks it
    result = await runner.validation_pass(
        data.validation_source(name),
        epoch=command.epoch,
        pass_index=command.pass_index,
        validation_set=name,
        share_result=command.share_result,
    )
    if command.share_result:
        record_evaluated(name, result)
    return result


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
