"""Where a run's state goes: one protocol, :class:`Storage`, and the storages behind it.

- :class:`DirectoryStorage` (:func:`lampdist.checkpoint.to_directory`) and
  :class:`UrlStorage` (:func:`lampdist.checkpoint.to_url`): atomic checkpoints in a
  directory or an object store, written on a worker thread or in the background, and able
  to hold every rank's shards (``step_on="fsdp"``);
- :class:`EffectStorage`: any other ``checkpoint_state`` effect, awaited as it is.

(Recovery keeps its snapshots in memory: ``lampdist._roles._run_state.MemoryStorage``.)
:func:`storage_for` is the one place that tells them apart; :func:`write_own_shards` the
one place that tells a rank's shards' target apart (a directory or an object store).

Adding a storage is one class here with :class:`Storage`'s methods and one line in
:func:`storage_for` (or a public constructor in :mod:`lampdist.checkpoint` returning it).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import anyio
import anyio.from_thread
import anyio.to_thread
import attrs
import torch

from .._effects import CheckpointState
from .._errors import ConfigError
from .._state import TrainingState
from ._background import StageOn, background_writes
from ._format import FileRecord
from ._object_store import (
    check_store_writable,
    is_url,
    new_store_shards,
    upload_rank_shards,
    write_to_store,
)
from ._rng import RngStates, capture_rng_states
from ._shards import ShardedState, write_rank_shards
from ._write import check_writable, new_shards_directory, write_checkpoint

__all__ = [
    "WRITE_TIMEOUT",
    "DirectoryStorage",
    "EffectStorage",
    "FileStorage",
    "Saver",
    "Storage",
    "UrlStorage",
    "check_storage_options",
    "storage_for",
    "write_own_shards",
]

WRITE_TIMEOUT = 600.0
"""How long, by default, a checkpoint due (or the run's end) waits for an asynchronous
write still in flight before that write is aborted and the run ends with a CheckpointError."""


class Saver(Protocol):
    """A storage open for one run (see :meth:`Storage.opened`): what the state component
    saves through."""

    async def save(
        self, training_state: TrainingState, lr_state: Any, *, stage_on: StageOn
    ) -> None:
        """Save ``training_state`` and the schedule state ``lr_state``; ``stage_on`` runs a
        copy of the state on the thread that owns it (the compute thread)."""

    def check(self) -> None:
        """Raise what a save in the background failed with (nothing by default)."""

    async def finish(self) -> None:
        """Wait for a save still in flight."""


class Storage(Protocol):
    """Where a run's state goes (see the module docstring)."""

    @property
    def holds_shards(self) -> bool:
        """Whether every rank can write its own shards into it (:meth:`new_shards`)."""

    async def check_before_training(self, next_epoch: int, *, resumed: bool) -> None:
        """Raise CheckpointError now, not after an epoch, when the run's state cannot go
        here (a run starting or resuming at ``next_epoch``)."""

    def new_shards(self, epoch: int, nranks: int, precision: Mapping[str, Any]) -> ShardedState:
        """Where the ranks write their shards of the checkpoint of ``epoch`` (only where
        :attr:`holds_shards`)."""

    def opened(self) -> contextlib.AbstractAsyncContextManager[Saver]:
        """The storage open for one run: a :class:`Saver`, closed (its writes finished or
        aborted) with the block."""


def check_storage_options(keep: int, asynchronous: bool, timeout: float) -> None:
    """Raise ConfigError for the bad options of :func:`lampdist.checkpoint.to_directory`."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ConfigError(f"keep must be an int >= 1, not {keep!r}", phase="checkpoint")
    if not isinstance(asynchronous, bool):
        raise ConfigError(
            f"asynchronous must be True or False, not {asynchronous!r}", phase="checkpoint"
        )
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise ConfigError(
            f"timeout must be a positive number of seconds, not {timeout!r}", phase="checkpoint"
        )


@attrs.frozen
class _Awaiting:
    """A :class:`Saver` that awaits an effect: it writes before returning."""

    effect: CheckpointState

    async def save(
        self, training_state: TrainingState, lr_state: Any, *, stage_on: StageOn
    ) -> None:
        await self.effect(training_state, lr_state)

    def check(self) -> None:
        return

    async def finish(self) -> None:
        return


@attrs.frozen(kw_only=True)
class FileStorage:
    """What :class:`DirectoryStorage` and :class:`UrlStorage` share: a blocking ``write`` and
    ``check_writable`` run on a worker thread, and the effect itself (awaited, it writes
    before returning)."""

    keep: int
    asynchronous: bool = False
    timeout: float = WRITE_TIMEOUT
    holds_shards = True

    def where(self) -> str:
        raise NotImplementedError

    def write(
        self, training_state: TrainingState, lr_state: Any, rng: RngStates, check: Any
    ) -> object:
        raise NotImplementedError

    def check_writable(self, next_epoch: int, *, resumed: bool) -> None:
        raise NotImplementedError

    def new_shards(self, epoch: int, nranks: int, precision: Mapping[str, Any]) -> ShardedState:
        raise NotImplementedError

    async def check_before_training(self, next_epoch: int, *, resumed: bool) -> None:
        check = functools.partial(self.check_writable, next_epoch, resumed=resumed)
        await anyio.to_thread.run_sync(check)

    @contextlib.asynccontextmanager
    async def opened(self) -> AsyncIterator[Saver]:
        """Writes in the background (the rules of ``_background``) when asynchronous, else
        awaited."""
        if self.asynchronous:
            async with background_writes(self) as writer:
                yield writer
        else:
            yield _Awaiting(self)

    async def __call__(self, training_state: TrainingState, lr_state: Any, /) -> None:
        rng = capture_rng_states()  # on the caller's thread, at the moment of the call
        write = functools.partial(
            self.write, training_state, lr_state, rng, anyio.from_thread.check_cancelled
        )
        await anyio.to_thread.run_sync(write)


@attrs.frozen(kw_only=True)
class DirectoryStorage(FileStorage):
    """The storage :func:`lampdist.checkpoint.to_directory` returns."""

    directory: Path

    def where(self) -> str:
        return str(self.directory)

    def write(
        self, training_state: TrainingState, lr_state: Any, rng: RngStates, check: Any
    ) -> object:
        return write_checkpoint(
            self.directory, training_state, lr_state, rng, keep=self.keep, check=check
        )

    def check_writable(self, next_epoch: int, *, resumed: bool) -> None:
        check_writable(self.directory, next_epoch, resumed=resumed)

    def new_shards(self, epoch: int, nranks: int, precision: Mapping[str, Any]) -> ShardedState:
        return new_shards_directory(self.directory, nranks, precision)


@attrs.frozen(kw_only=True)
class UrlStorage(FileStorage):
    """The storage :func:`lampdist.checkpoint.to_url` returns."""

    url: str
    options: Mapping[str, str] | None = attrs.field(default=None, repr=False)

    def where(self) -> str:
        return self.url

    def write(
        self, training_state: TrainingState, lr_state: Any, rng: RngStates, check: Any
    ) -> object:
        return write_to_store(
            self.url,
            training_state,
            lr_state,
            rng,
            keep=self.keep,
            check=check,
            options=self.options,
        )

    def check_writable(self, next_epoch: int, *, resumed: bool) -> None:
        check_store_writable(self.url, next_epoch, resumed=resumed, options=self.options)

    def new_shards(self, epoch: int, nranks: int, precision: Mapping[str, Any]) -> ShardedState:
        return new_store_shards(self.url, epoch, nranks, precision, self.options)


@attrs.frozen
class EffectStorage:
    """Any other ``checkpoint_state`` effect: awaited with the state after each checkpoint
    due; it checks nothing before training (it is the caller's own) and holds no shards."""

    effect: CheckpointState
    holds_shards = False

    async def check_before_training(self, next_epoch: int, *, resumed: bool) -> None:
        return

    def new_shards(self, epoch: int, nranks: int, precision: Mapping[str, Any]) -> ShardedState:
        raise AssertionError("an effect of the caller's own holds no shards")

    @contextlib.asynccontextmanager
    async def opened(self) -> AsyncIterator[Saver]:
        yield _Awaiting(self.effect)


def storage_for(effect: CheckpointState) -> Storage:
    """The storage behind a ``checkpoint_state`` effect: the effect itself when
    :func:`lampdist.checkpoint.to_directory` or ``to_url`` made it, else
    :class:`EffectStorage`."""
    if isinstance(effect, FileStorage):
        return effect
    return EffectStorage(effect)


def write_own_shards(
    target: ShardedState, module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, rank: int
) -> list[FileRecord]:
    """Write this rank's shards of ``module`` and ``optimizer`` where the root's ``target``
    says (a collective: every rank calls it): into its directory, or uploaded by each rank to
    its object store. Their files' records, named relative to the checkpoint."""
    if is_url(target.path):
        return upload_rank_shards(target, module, optimizer, rank=rank)
    return write_rank_shards(Path(target.path).parent, module, optimizer, rank=rank)
