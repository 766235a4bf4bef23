"""Batch sources read one batch ahead, off the event loop, onto the rank's device."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Sized
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
import anyio.to_thread
import attrs
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._effects import BatchSource
from .._errors import BadBatch, LampdistError, TrainingError
from .._signal import loop_scheduler
from ._model import SupervisedModel, check_batch, move_to_device

__all__ = ["BatchReader", "LoadedBatch", "open_batches"]

_END = object()


@attrs.frozen
class LoadedBatch:
    """One batch on the rank's device, with its example count."""

    inputs: Any
    target: Any
    examples: int


@attrs.define(eq=False)
class BatchReader:
    """Reads the batches that :func:`open_batches` loads ahead."""

    _receive: MemoryObjectReceiveStream[LoadedBatch]
    total: int | None = None
    _room: threading.Semaphore | None = None  # given back per batch taken (sync sources)
    _peeked: LoadedBatch | None = None
    _done: bool = False
    batches_read: int = 0

    async def next(self) -> LoadedBatch | None:
        """The next batch, or ``None`` once the source is exhausted."""
        if self._peeked is None and not await self.has_next():
            return None
        batch, self._peeked = self._peeked, None
        self.batches_read += 1
        return batch

    async def has_next(self) -> bool:
        """Whether another batch follows (waits for it to load)."""
        if self._peeked is not None:
            return True
        if self._done:
            return False
        try:
            self._peeked = await self._receive.receive()
        except anyio.EndOfStream:
            self._done = True
            return False
        if self._room is not None:
            self._room.release()
        return True


@asynccontextmanager
async def open_batches(
    source: BatchSource,
    *,
    model: SupervisedModel,
    device: torch.device,
    rank: int,
    phase: str,
    prefetch: int = 2,
) -> AsyncIterator[BatchReader]:
    """Call ``source()`` and load its batches ``prefetch`` ahead while the caller computes.

    Sync iterables are advanced in a worker thread (one for the pass), so a slow
    ``DataLoader`` never blocks the event loop. Raises :class:`TrainingError` (rank and
    phase named) when the source raises, and :class:`BadBatch` when it yields something that
    is not an ``(inputs, target)`` batch.
    """
    try:
        iterable = source()
    except Exception as exc:
        raise TrainingError(
            f"the {phase} batch source factory raised {type(exc).__name__}: {exc}",
            rank=rank,
            phase=phase,
        ) from exc
    if not isinstance(iterable, Iterable | AsyncIterable):
        raise BadBatch(
            f"a batch source must return an iterable or async iterable of (inputs, target) "
            f"batches, got {type(iterable).__name__}",
            rank=rank,
            phase=phase,
        )
    total = len(iterable) if isinstance(iterable, Sized) else None
    send, receive = anyio.create_memory_object_stream[LoadedBatch](prefetch)
    room = threading.Semaphore(prefetch)  # batches the loading thread may still hand over
    stopped = threading.Event()
    async with anyio.create_task_group() as group, receive:
        group.start_soon(_produce, iterable, send, room, stopped, model, device, rank, phase)
        try:
            yield BatchReader(receive, total, None if isinstance(iterable, AsyncIterable) else room)
        finally:
            stopped.set()
            room.release()  # wakes the loading thread if it waits for room
            group.cancel_scope.cancel()


async def _produce(
    iterable: Iterable[object] | AsyncIterable[object],
    send: MemoryObjectSendStream[LoadedBatch],
    room: threading.Semaphore,
    stopped: threading.Event,
    model: SupervisedModel,
    device: torch.device,
    rank: int,
    phase: str,
) -> None:
    """Load the batches into ``send``: async iterables on the loop, sync ones on one worker
    thread for the whole pass, which hands each batch to the loop with a thread-safe
    callback (no thread hand-off per batch)."""

    def load(batch: object) -> LoadedBatch:
        inputs, target = check_batch(batch)
        examples = model.example_count(target)
        return LoadedBatch(move_to_device(inputs, device), move_to_device(target, device), examples)

    run_soon = loop_scheduler()

    def hand_over(loaded: LoadedBatch) -> None:  # on the loop
        try:
            send.send_nowait(loaded)  # never full: the thread waited for room
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            stopped.set()  # the reader stopped early

    def load_all(iterator: Iterator[object]) -> None:  # on the loading thread
        while True:
            room.acquire()
            if stopped.is_set():
                return
            batch = next(iterator, _END)
            if batch is _END:
                return
            run_soon(partial(hand_over, load(batch)))

    async with send:
        try:
            if isinstance(iterable, AsyncIterable):
                async for batch in iterable:
                    await send.send(load(batch))
                return
            # Abandoned on cancellation: a slow source's next() need not be waited for, and
            # the thread returns once it finds ``stopped`` set.
            await anyio.to_thread.run_sync(
                load_all, iter(iterable), limiter=anyio.CapacityLimiter(1), abandon_on_cancel=True
            )
            # The thread's hand-overs were scheduled before its return was: they ran first.
        except BadBatch as exc:
            raise BadBatch(exc.message, rank=rank, phase=phase) from exc
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return  # the reader stopped early
        except LampdistError:
            raise
        except Exception as exc:
            raise TrainingError(
                f"the {phase} batch source raised {type(exc).__name__}: {exc}",
                rank=rank,
                phase=phase,
            ) from exc
