"""Batches from the loading thread straight to the compute thread, a few ahead.

A pass's batch source is advanced on a loading thread of its own (an async iterable on the
event loop instead), which checks each batch, moves it to the rank's device and puts it into
a :class:`BatchFeed`; the compute thread takes it from there. The event loop is not on this
path: it opens the feed, and stops it when the pass is cancelled.

The loading thread runs torch ops with one intra-op thread: a thread that runs
intra-op-parallel ops keeps an OpenMP team, which slows the compute thread's ops while it
lives (a ``DataLoader`` without workers collates on this thread).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Sized
from contextlib import asynccontextmanager
from typing import Any

import anyio
import attrs
import torch

from .._effects import BatchSource, PassAwareBatchSource
from .._errors import BadBatch, LampdistError, TrainingError
from .._model import BatchModel
from .._source import PassContext, PassKind, call_source
from .._wakeup import Wakeup

__all__ = [
    "AHEAD",
    "BatchFeed",
    "LoadedBatch",
    "Loader",
    "PassStopped",
    "call_checked",
    "open_feed",
]

AHEAD = 4
"""How many batches the loading thread may load ahead of the compute thread. It is woken to
load more once half of them have been taken: every other step, not every step."""


class PassStopped(BaseException):
    """Raised on the compute thread when the event loop stopped the pass (it was cancelled).

    A ``BaseException``, like a cancellation: model code's ``except Exception`` does not
    swallow it."""


@attrs.frozen
class LoadedBatch:
    """One batch on the rank's device, with its counts."""

    data: Any
    """The batch as the model takes it (see :meth:`lampdist._model.BatchModel.load`)."""
    examples: int
    """Its examples, as reported (events, throughput)."""
    position: Any = None
    """On a training stream, the rank's place in its data right after this batch, when the
    batch ends a window (a :class:`~lampdist._epoch._stream.StreamPosition`)."""
    number: int = 0
    """Where the batch comes among the batches of its feed, from 0 (its index in a pass, for
    error messages, is this less the batches the feed handed out before the pass)."""
    tokens: int | None = None
    """The batch's tokens, when it says (see :attr:`lampdist.SupervisedModel.token_count`)."""
    weight: int = 0
    """What the batch's mean loss is a mean over (its examples or its tokens, by the model's
    ``mean_over``): what weights its loss and gradients in a step and a pass, summed over
    the accumulation window and every rank. A batch of weight 0 is skipped."""


@attrs.define(eq=False)
class BatchFeed:
    """A bounded hand-off of batches between two threads.

    Invariant: at most ``ahead`` batches wait in ``_ready``; the producer (loading thread or
    event loop) blocks or waits for room, the consumer (compute thread) for a batch, and the
    consumer wakes the producer only once ``_ready`` is down to half. Once
    :meth:`stop` is called, the consumer raises :class:`PassStopped` and the producer's puts
    return False.
    """

    total: int | None
    """The source's length when it has one, else ``None``."""
    intra_op_threads: int
    """torch's intra-op default to put back after the loading thread lowered it."""
    ahead: int = AHEAD
    batches_read: int = 0
    """Batches the consumer has taken (peeked ones not counted)."""
    position: Any = None
    """The stream position of the last batch taken that carried one (see ``_stream``)."""
    loaded: int = 0
    """Batches the producer has loaded (their numbers; only the producer writes it)."""
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)
    _changed: threading.Condition = attrs.field(init=False, repr=False)
    _ready: collections.deque[LoadedBatch] = attrs.field(factory=collections.deque, init=False)
    _ended: bool = attrs.field(default=False, init=False)
    _error: BaseException | None = attrs.field(default=None, init=False, repr=False)
    _stopped: bool = attrs.field(default=False, init=False)
    _peeked: collections.deque[LoadedBatch] = attrs.field(
        factory=collections.deque, init=False, repr=False
    )
    """Batches off ``_ready``, not handed out yet (:meth:`has_next`, :meth:`peek_weighted`)."""
    _room: Wakeup | None = attrs.field(default=None, init=False, repr=False)
    _lowered: bool = attrs.field(default=False, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self._changed = threading.Condition(self._lock)

    # -- the producer ---------------------------------------------------------------------

    def claim_loading_thread(self) -> bool:
        """Give the calling (loading) thread one intra-op thread; False if already stopped.

        ``torch.set_num_threads`` sets the calling thread's count and torch's process-wide
        default, which threads start from: the default is put back by the consumer's first
        take or by :meth:`stop`, while this thread keeps its own count.
        """
        with self._lock:
            if self._stopped:
                return False
            torch.set_num_threads(1)
            torch.get_num_threads()  # fixes this thread's count before the default is back
            self._lowered = True
            return True

    def _restore_default(self) -> None:  # under the lock
        if self._lowered:
            self._lowered = False
            torch.set_num_threads(self.intra_op_threads)

    def put(self, batch: LoadedBatch) -> bool:
        """Hand over ``batch``, waiting for room; False once the feed is stopped (a thread)."""
        with self._changed:
            while len(self._ready) >= self.ahead and not self._stopped:
                self._changed.wait()
            if self._stopped:
                return False
            self._ready.append(batch)
            self._changed.notify_all()
            return True

    async def put_async(self, batch: LoadedBatch) -> bool:
        """:meth:`put` for a producer on the event loop: waits for room without blocking it."""
        while True:
            with self._changed:
                if self._stopped:
                    return False
                if len(self._ready) < self.ahead:
                    self._ready.append(batch)
                    self._changed.notify_all()
                    return True
                room = self._room = Wakeup()
            await room.wait()

    def finish(self, error: BaseException | None = None) -> None:
        """The source is exhausted (``error`` is None) or failed with ``error``."""
        with self._changed:
            self._ended = True
            self._error = error
            self._changed.notify_all()

    # -- the consumer (the compute thread) --------------------------------------------------

    def next(self) -> LoadedBatch | None:
        """The next batch, or ``None`` once the source is exhausted; raises its error, or
        :class:`PassStopped`."""
        if not self.has_next():
            return None
        batch = self._peeked.popleft()
        self.batches_read += 1
        if batch.position is not None:
            self.position = batch.position
        return batch

    def has_next(self) -> bool:
        """Whether another batch follows (waits for it to load)."""
        return bool(self._peeked) or self._peek()

    def peek_weighted(self) -> LoadedBatch | None:
        """The first batch still to come whose weight is not 0, without taking it (those
        before it are kept, in order), or ``None`` when the source ends first (waits for
        them to load): what a rank without a batch so far can run a padding pass on."""
        index = 0
        while index < len(self._peeked) or self._peek():
            if self._peeked[index].weight > 0:
                return self._peeked[index]
            index += 1
        return None

    def _peek(self) -> bool:
        """Move the next loaded batch to ``_peeked``; False once the source is exhausted."""
        with self._changed:
            while not self._ready and not self._ended and not self._stopped:
                self._changed.wait()
            self._restore_default()
            if self._stopped:
                raise PassStopped
            if not self._ready:
                if self._error is not None:
                    raise self._error
                return False
            self._peeked.append(self._ready.popleft())
            if len(self._ready) > self.ahead // 2:
                return True  # the producer may sleep on: no wake-up every step
            self._changed.notify_all()
            room, self._room = self._room, None
        if room is not None:
            room.set()
        return True

    # -- the event loop -----------------------------------------------------------------------

    def stop(self) -> None:
        """Stop both sides (from any thread): the pass ends or was cancelled."""
        with self._changed:
            self._stopped = True
            self._restore_default()
            self._ready.clear()
            self._changed.notify_all()
            room, self._room = self._room, None
        if room is not None:
            room.set()

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stopped


@asynccontextmanager
async def open_feed(
    source: BatchSource | PassAwareBatchSource,
    context: PassContext,
    *,
    model: BatchModel,
    device: torch.device,
    rank: int,
    phase: PassKind,
    intra_op_threads: int,
    ahead: int = AHEAD,
) -> AsyncIterator[BatchFeed]:
    """Call ``source()`` (or ``source(context)``, see :mod:`lampdist._source`) and load its
    batches ``ahead`` ahead into a :class:`BatchFeed`.

    Sync iterables are advanced on a loading thread for the pass (so a slow ``DataLoader``
    never blocks the event loop); async iterables on the event loop. The feed is stopped when
    the block ends; a loading thread stuck in the source's ``next()`` is left to return on
    its own. The consumer raises :class:`TrainingError` (rank and phase named) when the
    source raises, and :class:`BadBatch` when it yields something that is not an ``(inputs,
    target)`` batch.
    """
    iterable = call_checked(source, context, rank=rank, phase=phase)
    feed = BatchFeed(
        total=len(iterable) if isinstance(iterable, Sized) else None,
        intra_op_threads=intra_op_threads,
        ahead=ahead,
    )
    loader = Loader(feed, model, device, rank, phase)
    try:
        if isinstance(iterable, AsyncIterable):
            async with anyio.create_task_group() as group:
                group.start_soon(loader.load_async, iterable)
                try:
                    yield feed
                finally:
                    feed.stop()
                    group.cancel_scope.cancel()
        else:
            thread = threading.Thread(
                target=loader.load, args=(iterable,), name=f"lampdist-load-{rank}", daemon=True
            )
            thread.start()
            yield feed
    finally:
        feed.stop()


def call_checked(
    source: BatchSource | PassAwareBatchSource, context: PassContext, *, rank: int, phase: PassKind
) -> Iterable[object] | AsyncIterable[object]:
    """``source()`` (or ``source(context)``), its errors as :class:`TrainingError` and
    anything but an iterable or async iterable as :class:`BadBatch`, naming the rank and
    phase."""
    try:
        iterable = call_source(source, context)
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
    return iterable


@attrs.frozen
class Loader:
    """Puts a source's batches into ``feed``: checked, counted and on the device."""

    feed: BatchFeed
    model: BatchModel
    device: torch.device
    rank: int
    phase: PassKind

    def load_one(self, batch: object, position: Any = None) -> LoadedBatch:
        """``batch`` checked, counted and on the device (with its stream ``position``)."""
        data, examples, tokens, weight = self.model.load(batch, self.device)
        number = self.feed.loaded
        self.feed.loaded = number + 1
        return LoadedBatch(data, examples, position, number, tokens, weight)

    def load(self, iterable: Iterable[object]) -> None:
        """The loading thread: one intra-op thread, then every batch into the feed."""
        if not self.feed.claim_loading_thread():
            return
        try:
            iterator: Iterator[object] = iter(iterable)
            while not self.feed.stopped:
                batch = next(iterator, _END)
                if batch is _END or not self.feed.put(self.load_one(batch)):
                    break
        except BaseException as exc:
            self.feed.finish(self.translate(exc))
        else:
            self.feed.finish()

    async def load_async(self, iterable: AsyncIterable[object]) -> None:
        """The producer for an async source, on the event loop."""
        try:
            async for batch in iterable:
                if not await self.feed.put_async(self.load_one(batch)):
                    return
        except Exception as exc:
            self.feed.finish(self.translate(exc))
        else:
            self.feed.finish()

    def translate(self, exc: BaseException) -> BaseException:
        """The source's error as the pass raises it, naming the rank and phase."""
        if isinstance(exc, BadBatch):
            error: BaseException = BadBatch(exc.message, rank=self.rank, phase=self.phase)
        elif isinstance(exc, LampdistError) or not isinstance(exc, Exception):
            return exc
        else:
            error = TrainingError(
                f"the {self.phase} batch source raised {type(exc).__name__}: {exc}",
                rank=self.rank,
                phase=self.phase,
            )
        error.__cause__ = exc
        return error


_END = object()
