"""A run's state in one component, on the root: what it is, where it goes, when.

**What.** A :class:`~lampdist.TrainingState`: the model (the root's whole one, or where the
design shards it, every rank's shards), the optimizer (the root's, gathered whole from the
ranks' slices, or shards), the best model, the loop state, the schedule state beside it, and
each rank's own state (:class:`~lampdist._epoch.RankState`: its place in its data and its RNG
states). :meth:`RunState.capture` takes it, every rank at once (the CHECKPOINT command: each
rank hands the root its part, see :meth:`StepKernel.checkpoint_parts`); the design
contributes its parts and writes its shards where the storage says.

**Where.** A :class:`~lampdist._checkpoint.Storage`: the ``checkpoint_state`` effect's
(:func:`~lampdist._checkpoint.storage_for` chooses: a directory, an object store, or an
effect of the caller's own), and for in-job recovery :class:`MemoryStorage`. Both are
chosen in :meth:`RunState.create`, the one place.

**When.** :class:`SaveRule`: after every epoch, or with ``checkpoint_interval`` once that
many seconds have passed; always after the last epoch and on a stop; an epoch the interval
skipped is saved when the loop ends after it. Recovery keeps a snapshot after every effect
all ranks carry out (``_generations``).

The root's checkpoints and recovery's snapshots go through the same :meth:`RunState.save`
(capture, then the storage), and a resumed run and a recovery come back through the same
:meth:`RunState.load` and :meth:`RunState.settle`.

Adding a piece of state: a rank's own is a field of ``RankState``; the root's a field of
``TrainingState``, captured in :meth:`RunState.capture`, loaded in :func:`load_state` (and
stored by ``_checkpoint._write``/``_read``). Adding a storage: see ``_checkpoint._storage``.
Adding a save rule: :meth:`SaveRule.due`.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from functools import partial
from typing import Any, TypeVar

import anyio
import attrs
import torch

from .._checkpoint import (
    FileStorage,
    Saver,
    ShardedState,
    StageOn,
    Storage,
    UrlStorage,
    by_index,
    local_shards,
    read_whole,
)
from .._epoch import IN_MEMORY, Design, PassRunner, RankState, flat_order
from .._errors import CheckpointError, LampdistError
from .._model import original_module
from .._options import LoopOptions
from .._state import LoopState, TrainingState
from ..checkpoint import Resumed, load_latest
from ..control import Command, CommandKind, RootChannel
from ._commands import order
from ._rank import RankContext
from ._resume import (
    check_schedule_state,
    fitting_model_state,
    load_model_state,
    load_optimizer_state,
    restore_rng,
)

__all__ = ["MemoryStorage", "RunState", "SaveRule", "load_state"]

T = TypeVar("T")

Guard = Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]]
"""Runs an effect every rank carries out (under recovery, redone after a loss)."""


@attrs.define(eq=False)
class MemoryStorage:
    """Recovery's storage: the newest state, copied into memory (training goes on in place);
    no loop state and no best model (a recovery goes back to the ranks' state only)."""

    held: Resumed | None = None
    holds_shards = False

    async def check_before_training(self, next_epoch: int, *, resumed: bool) -> None:
        return

    def new_shards(self, epoch: int, nranks: int, precision: Mapping[str, Any]) -> ShardedState:
        raise AssertionError("recovery's memory holds no shards")

    @contextlib.asynccontextmanager
    async def opened(self) -> AsyncIterator[Saver]:
        yield self

    async def save(
        self, training_state: TrainingState, lr_state: Any, *, stage_on: StageOn
    ) -> None:
        self.held = await stage_on(partial(_kept, training_state))

    def check(self) -> None:
        return

    async def finish(self) -> None:
        return

    def latest(self) -> Resumed:
        """A copy of the newest state to load (on the compute thread): loading may alias a
        state's tensors into the optimizer, which then steps them, and a second loss within
        the same pass goes back to the same state."""
        assert self.held is not None  # a snapshot is kept before training
        state = self.held.training_state
        return attrs.evolve(self.held, training_state=_copied(state))


def _copied(state: TrainingState) -> TrainingState:
    """``state`` with its model and optimizer state copied (the optimizer's deep-copied: its
    tensors are the optimizer's own)."""
    return attrs.evolve(
        state,
        model_state={name: tensor.detach().clone() for name, tensor in state.model_state.items()},
        optimizer_state=copy.deepcopy(dict(state.optimizer_state)),
    )


def _kept(state: TrainingState) -> Resumed:
    """What recovery keeps of ``state``: copies of the ranks' state, the root's RNG states."""
    assert state.rank_states is not None  # every capture has them
    kept = attrs.evolve(_copied(state), loop_state=LoopState(), best_model_state=None)
    rng = RankState.from_plain(state.rank_states[0]).rng
    return Resumed(training_state=kept, rng_states=rng)


@attrs.define
class SaveRule:
    """When the epochs' state is saved (see the module docstring)."""

    interval: float | None
    max_epochs: int
    stop_requested: Callable[[], bool]
    last: float = 0.0
    """When the last checkpoint was taken (``time.monotonic()``), or training began."""

    def due(self, state: LoopState) -> bool:
        """Whether the end of the epoch before ``state.epoch`` is saved now."""
        if self.interval is None or state.epoch >= self.max_epochs or self.stop_requested():
            return True
        return time.monotonic() - self.last >= self.interval

    def restart(self) -> None:
        """Count the interval from now."""
        self.last = time.monotonic()


def load_state(
    design: Design, module: torch.nn.Module, device: torch.device, resume: Resumed
) -> tuple[Resumed, dict[str, torch.Tensor] | None]:
    """Load ``resume``'s model and optimizer state into the root's (on the compute thread);
    the state to hand the design and the best model, if it holds one. A design that loads
    checkpoints itself (fsdp) gets the model state checked and keyed as the model's, and
    loads it once sharded (see :meth:`Design.prepare`)."""
    state = resume.training_state
    if design.loads_checkpoints:  # fsdp: every rank loads its shards once sharded
        if state.shards is None:
            fitted = fitting_model_state(module, state.model_state, path=resume.path)
            resume = attrs.evolve(resume, training_state=attrs.evolve(state, model_state=fitted))
        return resume, None
    model_state, optimizer_state = state.model_state, state.optimizer_state
    if state.shards is not None:  # written by fsdp: read whole here
        with local_shards(state.shards.path, state.shards.options) as path:
            model_state, named = read_whole(path)
        optimizer_state = by_index(named, flat_order(original_module(module)))
    load_model_state(module, model_state, path=resume.path)
    stepper = design.stepper
    assert stepper is not None  # the root steps in every design but fsdp
    load_optimizer_state(stepper, optimizer_state, path=resume.path)
    if state.best_model_state is None:
        return resume, None
    best = fitting_model_state(module, state.best_model_state, path=resume.path, what="best-model")
    return resume, _on(device, best)


def _on(device: torch.device, state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A copy of ``state`` on ``device``."""
    return {name: tensor.detach().to(device, copy=True) for name, tensor in state.items()}


@attrs.define(eq=False)
class RunState:
    """The root's run state: capture, save, load, settle (see the module docstring)."""

    context: RankContext
    control: RootChannel
    loop: LoopOptions
    checkpoints: Storage | None
    """Where the epochs' checkpoints go (``None``: no ``checkpoint_state``)."""
    memory: MemoryStorage | None
    """Where recovery's snapshots go (``None``: no recovery)."""
    rule: SaveRule
    runner: Callable[[], PassRunner]
    """The pass runner of the clique's current generation."""
    guarded: Guard
    """How an effect every rank carries out runs (see ``Generations.guarded``)."""
    where: Callable[[], tuple[int, int]]
    """The root's epoch and pass index now (what a CHECKPOINT command carries)."""
    best_model: dict[str, torch.Tensor] | None = None
    saver: Saver | None = None
    """The checkpoints' storage, open while the epochs run."""
    unsaved: tuple[LoopState, Any] | None = None
    """The last epoch's state and schedule state, if the rule skipped it."""
    saved_passes: dict[int, int] = attrs.field(factory=dict)
    """The root's pass index at each checkpoint this process captured, by epoch."""
    snapshots: int = 0
    """Recovery's snapshots begun: each one's name for the ranks that keep their shards."""

    @classmethod
    def create(
        cls,
        context: RankContext,
        control: RootChannel,
        loop: LoopOptions,
        checkpoints: Storage | None,
        *,
        runner: Callable[[], PassRunner],
        guarded: Guard,
        where: Callable[[], tuple[int, int]],
    ) -> RunState:
        """The run's state, its storages chosen: ``checkpoints`` (``storage_for`` the
        ``checkpoint_state``), and memory under recovery."""
        rule = SaveRule(loop.checkpoint_interval, loop.max_epochs, context.stopping.requested)
        memory = MemoryStorage() if loop.recovery is not None else None
        return cls(context, control, loop, checkpoints, memory, rule, runner, guarded, where)

    # -- what ---------------------------------------------------------------------------------

    async def capture(
        self, runner: PassRunner, *, epoch: int, pass_index: int, shards: ShardedState | None
    ) -> TrainingState:
        """Every rank's part of the state now, gathered on the root (CHECKPOINT), and the
        root's model (its state dict, live: save it before training goes on), under a blank
        loop state; with ``shards``, every rank writes its shards there instead."""
        context = self.context
        command = Command(kind=CommandKind.CHECKPOINT, epoch=epoch, pass_index=pass_index)
        parts = await order(self.control, runner, context.data, command, context.tracker, shards)
        assert parts is not None  # on the root
        if shards is None:
            module = original_module(context.data.model.module)
            model_state = await context.compute.run(module.state_dict)
        else:
            model_state = {}
            shards = attrs.evolve(shards, records=parts.shard_records)
        return TrainingState(
            loop_state=LoopState(),
            model_state=model_state,
            optimizer_state=parts.optimizer_state,
            rank_states=parts.rank_states,
            shards=shards,
        )

    # -- where and when -----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def opened(self) -> AsyncIterator[None]:
        """The checkpoints' storage open around the epochs (an asynchronous one writes in the
        background and is waited for, or aborted, on the way out)."""
        if self.checkpoints is None:
            yield
            return
        async with self.checkpoints.opened() as self.saver:
            yield

    def check_saves(self) -> None:
        """Raise what an asynchronous checkpoint failed with (an epoch boundary)."""
        if self.saver is not None:
            self.saver.check()

    async def epoch_ended(self, state: LoopState, lr_state: Any) -> None:
        """The epoch driver's checkpoint effect: save now when the rule says so, else keep
        the state for :meth:`finish`."""
        if not self.rule.due(state):
            self.unsaved = (state, lr_state)
            return
        await self.save(state, lr_state)

    async def finish(self) -> None:
        """After the epochs: save the last epoch if the rule skipped it (a stop, early
        stopping or the schedule ended the loop after it)."""
        if self.unsaved is not None:
            await self.save(*self.unsaved)

    async def save(self, state: LoopState, lr_state: Any) -> None:
        """A checkpoint of the epoch before ``state.epoch``: captured (every rank, guarded),
        then written by the checkpoints' storage."""
        saver = self.saver
        assert self.checkpoints is not None and saver is not None
        self.unsaved = None
        epoch = state.epoch - 1
        check_schedule_state(self.loop.learning_rate_schedule, lr_state, epoch=epoch)
        shards = await self._new_shards(state.epoch)

        async def attempt() -> TrainingState:
            pass_index = self.where()[1]
            return await self.capture(
                self.runner(), epoch=epoch, pass_index=pass_index, shards=shards
            )

        captured = await self.guarded(attempt)
        self.saved_passes[epoch] = self.where()[1]
        training_state = attrs.evolve(captured, loop_state=state, best_model_state=self.best_model)
        self.rule.restart()
        try:
            await saver.save(training_state, lr_state, stage_on=self.context.compute.run)
        except LampdistError:
            raise
        except Exception as exc:
            raise CheckpointError(
                f"epoch {epoch}: checkpoint_state raised {type(exc).__name__}: {exc}",
                rank=0,
                phase="checkpoint",
            ) from exc

    async def _new_shards(self, epoch: int) -> ShardedState | None:
        """Where every rank writes its shards of this checkpoint, where the design shards
        (fsdp); ``None`` where the root holds the whole state."""
        if not self.context.design.loads_checkpoints:
            return None
        assert self.checkpoints is not None and self.saver is not None
        await self.saver.finish()  # the write in flight owns the directory's scratch until done
        precision = self.context.options.step.fsdp.precision.to_plain()
        new_shards = partial(self.checkpoints.new_shards, epoch, self.context.nranks, precision)
        return await anyio.to_thread.run_sync(new_shards)

    async def keep_snapshot(self, runner: PassRunner, *, epoch: int, pass_index: int) -> None:
        """Recovery: capture the state and keep it in memory (what a recovery goes back to);
        where the design shards (fsdp), every rank keeps its own shards and a neighbour's."""
        assert self.memory is not None
        shards = None
        if self.context.design.loads_checkpoints:
            self.snapshots += 1  # the ranks keep it beside the last one until it is taken
            shards = ShardedState(path=f"{IN_MEMORY}{self.snapshots}", nranks=self.context.nranks)
        captured = await self.capture(runner, epoch=epoch, pass_index=pass_index, shards=shards)
        await self.memory.save(captured, None, stage_on=self.context.compute.run)

    # -- back ---------------------------------------------------------------------------------

    async def load(self, resume: Resumed) -> Resumed:
        """Load ``resume`` into the root's model and optimizer (the compute thread) and take
        its best model, if it holds one; the state to :meth:`settle` with."""
        context = self.context
        load = partial(load_state, context.design, context.data.model.module, context.device)
        resume, best = await context.compute.run(load, resume)
        if best is not None:
            self.best_model = best
        return resume

    async def newest_checkpoint(self) -> Resumed | None:
        """Recovery under fsdp without its replica: the newest checkpoint in the checkpoints'
        storage (a write in flight finished first), its RNG states with it, as
        :func:`lampdist.checkpoint.load_latest` reads it for a resumed run; ``None`` before
        the first."""
        storage = self.checkpoints
        assert isinstance(storage, FileStorage) and self.saver is not None  # fsdp's are
        await self.saver.finish()
        options = storage.options if isinstance(storage, UrlStorage) else None
        read = partial(load_latest, storage.where(), restore_rng=True, options=options)
        return await anyio.to_thread.run_sync(read)

    async def load_snapshot(self) -> Resumed:
        """Recovery: load the newest snapshot (see :meth:`load`)."""
        assert self.memory is not None
        return await self.load(await self.context.compute.run(self.memory.latest))

    async def settle(self, runner: PassRunner, resume: Resumed | None) -> None:
        """Once the clique is open: every rank agrees and takes the root's state (the design's
        setup with ``resume``, the parameters, the optimizer state, each rank's own state;
        see :meth:`RankContext.agree_and_sync`), then the root's RNG states, when ``resume``
        restores them."""
        await self.context.agree_and_sync(runner, resume=resume)
        if resume is not None and resume.rng_states is not None:
            await self.context.compute.run(restore_rng, resume.rng_states)

    # -- the best model -----------------------------------------------------------------------

    async def save_best(self) -> None:
        """Keep a copy of the model now as the best one."""
        module = original_module(self.context.data.model.module)
        device = self.context.device
        self.best_model = await self.context.compute.run(lambda: _on(device, module.state_dict()))

    async def take_best(self) -> None:
        """Put the best model, if one was kept, into the root's model (the run's end)."""
        if self.best_model is not None:
            module = original_module(self.context.data.model.module)
            await self.context.compute.run(module.load_state_dict, self.best_model)
