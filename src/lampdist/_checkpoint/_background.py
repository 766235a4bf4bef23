"""Asynchronous checkpoints: the state staged in host memory, then written on a thread of
its own while training goes on.

The rules (:func:`background_writes` holds them for one run):

- At most one write is in flight. A checkpoint due while the previous one is still writing
  waits for it, up to the target's ``timeout``; past it the write in flight is aborted (its
  partial output removed) and the run ends with a CheckpointError of phase ``checkpoint``.
- A write that fails is reported at the next epoch boundary (:meth:`BackgroundWriter.check`),
  the next checkpoint, or the end of the run, whichever comes first: a CheckpointError of
  phase ``checkpoint`` naming the epoch, chained to the cause. Never swallowed.
- The end of the run and a run that fails wait for the write in flight (bounded by
  ``timeout``), so its checkpoint is committed; a cancellation aborts it instead, which
  removes its partial output. Nothing is ever left half committed: the writers commit by
  one rename (local) or one manifest (object stores) after every other file.

The writing thread runs at a lower priority (``nice`` 10 on Linux), so that on a host with
few cores the training thread keeps its share; the threads it starts inherit it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

import anyio
import anyio.to_thread
import attrs

from .._errors import CheckpointError
from .._state import TrainingState
from ._rng import RngStates, capture_rng_states
from ._staging import Staged, Staging

__all__ = ["ABORT_GRACE", "BackgroundWriter", "StageOn", "Writes", "background_writes"]

_log = logging.getLogger("lampdist.checkpoint")

T = TypeVar("T")

ABORT_GRACE = 30.0
"""How long an aborted write gets to notice and remove its partial output."""
_NICE = 10


class Writes(Protocol):
    """What the background writer needs of a checkpoint target (``to_directory``, ``to_url``)."""

    @property
    def timeout(self) -> float: ...

    def where(self) -> str: ...

    def write(
        self,
        training_state: TrainingState,
        lr_state: Any,
        rng: RngStates,
        check: Callable[[], None],
    ) -> object: ...


class StageOn(Protocol):
    """Runs the staging copies where the steps run (the compute thread)."""

    def __call__(self, function: Callable[[], T], /) -> Awaitable[T]: ...


class _Aborted(Exception):
    """Raised inside the writing thread by ``check`` once the write is aborted."""


@attrs.define(eq=False)
class BackgroundWriter:
    """One run's asynchronous checkpoints into ``target`` (see the module's rules)."""

    target: Writes
    staging: Staging = attrs.field(factory=Staging)
    blocked: list[float] = attrs.field(factory=list)
    """Seconds each :meth:`save` kept the caller (training) waiting, in order."""
    _thread: threading.Thread | None = None
    _done: threading.Event = attrs.field(factory=threading.Event)
    _abort: threading.Event = attrs.field(factory=threading.Event)
    _failure: BaseException | None = None
    _epoch: int = -1  # of the write in flight or last written

    @property
    def writing(self) -> bool:
        return self._thread is not None and not self._done.is_set()

    async def save(
        self, training_state: TrainingState, lr_state: Any, *, stage_on: StageOn
    ) -> None:
        """Stage ``training_state`` on ``stage_on`` and start writing it; returns once the
        copies are queued (a write still in flight is waited for first)."""
        started = time.perf_counter()
        epoch = training_state.loop_state.epoch - 1
        if self.writing:
            _log.info(
                "rank 0: the checkpoint of epoch %d waits for the one of epoch %d, still "
                "writing into %s",
                epoch,
                self._epoch,
                self.target.where(),
                extra={"rank": 0, "epoch": epoch},
            )
        await self._wait(f"epoch {epoch}'s checkpoint was due")
        self.check()
        rng = capture_rng_states()  # at the moment of the call, as a synchronous write does
        staged = await stage_on(
            functools.partial(
                self.staging.stage,
                training_state.model_state,
                training_state.optimizer_state,
                training_state.best_model_state,
                training_state.rank_states,
            )
        )
        self._epoch = epoch
        self._done.clear()
        self._abort.clear()
        self._thread = threading.Thread(
            target=self._run,
            args=(training_state, lr_state, rng, staged),
            name="lampdist-checkpoint-writer",
            daemon=True,
        )
        self._thread.start()
        self.blocked.append(time.perf_counter() - started)

    def check(self) -> None:
        """Raise the failure of the last write, if it failed (once)."""
        failure, self._failure = self._failure, None
        if failure is None:
            return
        if isinstance(failure, CheckpointError):
            detail = failure.message
        else:
            detail = f"{type(failure).__name__}: {failure}"
        raise CheckpointError(
            f"the asynchronous checkpoint of epoch {self._epoch} into {self.target.where()} "
            f"failed: {detail}; the checkpoints committed before it are intact",
            rank=0,
            phase="checkpoint",
        ) from failure

    async def finish(self) -> None:
        """Wait for the write in flight; raise its failure."""
        await self._wait("the run ended")
        self.check()

    async def abort(self) -> None:
        """Abort the write in flight and wait until its partial output is removed."""
        if not self.writing:
            return
        self._abort.set()
        await anyio.to_thread.run_sync(self._done.wait, ABORT_GRACE, abandon_on_cancel=True)
        if self._done.is_set():
            self._failure = None  # aborted on purpose
            _log.info(
                "rank 0: the asynchronous checkpoint of epoch %d was aborted; nothing of it "
                "is committed",
                self._epoch,
                extra={"rank": 0, "epoch": self._epoch},
            )
        else:
            _log.warning(
                "rank 0: the asynchronous checkpoint of epoch %d into %s did not stop within "
                "%.0f s of being aborted",
                self._epoch,
                self.target.where(),
                ABORT_GRACE,
                extra={"rank": 0, "epoch": self._epoch},
            )

    async def _wait(self, why: str) -> None:
        if not self.writing:
            return
        timeout = self.target.timeout
        await anyio.to_thread.run_sync(self._done.wait, timeout, abandon_on_cancel=True)
        if self._done.is_set():
            return
        await self.abort()
        raise CheckpointError(
            f"the asynchronous checkpoint of epoch {self._epoch} into {self.target.where()} "
            f"was still writing {timeout:g} s after {why}, and was aborted: raise the "
            "timeout, or write to faster storage",
            rank=0,
            phase="checkpoint",
        )

    def _run(
        self, training_state: TrainingState, lr_state: Any, rng: RngStates, staged: Staged
    ) -> None:
        _lower_priority()
        try:
            model, optimizer, best, ranks = staged.finish()  # the GPUs' part to the host
            state = attrs.evolve(
                training_state,
                model_state=model,
                optimizer_state=optimizer,
                best_model_state=best,
                rank_states=ranks,
            )
            self.target.write(state, lr_state, rng, self._check)
        except _Aborted:
            pass
        except BaseException as exc:  # reported by check(), at the next epoch boundary
            self._failure = exc
        finally:
            self._done.set()

    def _check(self) -> None:
        if self._abort.is_set():
            raise _Aborted


def _lower_priority() -> None:
    """Lower this thread's scheduling priority (Linux: ``nice`` is per thread)."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not permitted
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _NICE)


@contextlib.asynccontextmanager
async def background_writes(target: Writes) -> AsyncIterator[BackgroundWriter]:
    """A :class:`BackgroundWriter` for one run: on leaving, wait for the write in flight
    (after a failure of the run too; its own failure is then logged, not raised), or, on a
    cancellation, abort it."""
    writer = BackgroundWriter(target)
    try:
        yield writer
    except anyio.get_cancelled_exc_class():
        with anyio.CancelScope(shield=True):
            await writer.abort()
        raise
    except BaseException:
        with anyio.CancelScope(shield=True):
            try:
                await writer.finish()
            except CheckpointError as exc:
                _log.error("%s", exc.message, extra={"rank": 0})
        raise
    await writer.finish()
