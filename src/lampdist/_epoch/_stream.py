"""A rank's training data as one stream across epochs (``StepOptions.steps_per_epoch``).

With windows of N steps an epoch ends in the middle of the data, so the training source is not
called once per pass: a :class:`TrainStream` keeps one loading thread and one
:class:`BatchFeed` for the whole run. The thread calls the source for the rank's first pass
over its data, then again for the next pass whenever one runs out (the
:class:`~lampdist.PassContext` counts these passes in ``epoch``), so the stream never ends, and
every epoch takes exactly ``N * accumulate`` batches from it.

Where a window ends, the thread notes the rank's place in its data (:class:`StreamPosition`)
on the window's last batch, right after drawing it (batches loaded ahead do not count), and
with ``every`` (``Recovery.snapshot_every_steps``) also every that many batches into a window: the
pass over the data, the batches drawn from it, and the source's ``state_dict()`` when its
iterable has one (torchdata's ``StatefulDataLoader``). A resumed stream starts from such a
position: it calls the source for that pass and loads the state, or, for a source without
state, draws and drops that many batches (exact when the source yields the same batches for
the same context, as one that shuffles with ``context.generator()`` does). Such a replay costs
what reading those batches cost: one that runs past :data:`REPLAY_WARNING_SECONDS` is logged
once, naming the source and the batches it replays (a source with state resumes at once:
:class:`~lampdist.RandomBatches` for random draws, ``StatefulDataLoader`` for a loader).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs
import torch

from .._effects import BatchSource, PassAwareBatchSource
from .._errors import BadBatch, TrainingError
from .._model import BatchModel
from .._source import PassContext, pass_seed
from ._feed import AHEAD, BatchFeed, Loader, call_checked

__all__ = ["REPLAY_WARNING_SECONDS", "StreamPosition", "TrainStream"]

logger = logging.getLogger(__name__)

REPLAY_WARNING_SECONDS = 2.0
"""How long a resumed stream replays a source without state before it says so."""


@attrs.frozen(kw_only=True)
class StreamPosition:
    """A rank's place in its training data at the end of a window."""

    data_pass: int
    """Which pass over the data (0 for the first)."""
    batches: int
    """Batches drawn from that pass."""
    state: Any = None
    """The source iterable's ``state_dict()`` after them, when it has one."""

    def to_plain(self) -> dict[str, Any]:
        return {"data_pass": self.data_pass, "batches": self.batches, "state": self.state}

    @classmethod
    def from_plain(cls, data: dict[str, Any]) -> StreamPosition:
        return cls(data_pass=data["data_pass"], batches=data["batches"], state=data["state"])


@attrs.define(eq=False)
class TrainStream:
    """The endless training stream of one rank; :attr:`feed` is what its passes read."""

    feed: BatchFeed
    _thread: threading.Thread

    @classmethod
    def open(
        cls,
        source: BatchSource | PassAwareBatchSource,
        *,
        model: BatchModel,
        device: torch.device,
        rank: int,
        intra_op_threads: int,
        window: int,
        start: StreamPosition | None,
        context: Callable[[int], PassContext],
        every: int | None = None,
        into: int = 0,
    ) -> TrainStream:
        """Start the loading thread of rank ``rank``, which puts ``model``'s batches on
        ``device``; ``window`` is the batches of one epoch, ``context(k)`` the context of pass
        ``k`` over the data; a position is also noted every ``every`` batches into a window;
        ``start`` lies ``into`` batches into one (a recovery within a window)."""
        feed = BatchFeed(total=None, intra_op_threads=intra_op_threads, ahead=AHEAD)
        loader = Loader(feed, model, device, rank, "train")
        thread = threading.Thread(
            target=_run,
            args=(
                source,
                loader,
                _Marks(window, every, into),
                start or StreamPosition(data_pass=0, batches=0),
                context,
            ),
            name=f"lampdist-load-{loader.rank}",
            daemon=True,
        )
        thread.start()
        return cls(feed, thread)

    def close(self) -> None:
        """Stop the stream (the loading thread ends at its next batch)."""
        self.feed.stop()


def stream_context(shuffle_seed: int, rank: int, nranks: int) -> Callable[[int], PassContext]:
    """The context of a rank's ``k``-th pass over its training data."""

    def context(data_pass: int) -> PassContext:
        seed = pass_seed(shuffle_seed, rank, data_pass, "train")
        return PassContext(epoch=data_pass, kind="train", rank=rank, nranks=nranks, seed=seed)

    return context


@attrs.define
class _Marks:
    """Where the stream notes its position: at each window's end and, with ``every``, every
    that many batches into a window; ``drawn`` counts the batches into the window."""

    window: int
    every: int | None
    drawn: int

    def next_marks(self) -> bool:
        """Count one batch drawn: whether its position is noted."""
        self.drawn = self.drawn % self.window + 1
        return self.drawn == self.window or (
            self.every is not None and self.drawn % self.every == 0
        )


def _run(
    source: BatchSource | PassAwareBatchSource,
    loader: Loader,
    marks: _Marks,
    start: StreamPosition,
    context: Callable[[int], PassContext],
) -> None:
    """The loading thread: the stream into the feed, then its end or its error."""
    feed = loader.feed
    if not feed.claim_loading_thread():
        return
    try:
        _load(source, loader, marks, start, context)
    except BaseException as exc:
        feed.finish(loader.translate(exc))
    else:
        feed.finish()


def _load(
    source: BatchSource | PassAwareBatchSource,
    loader: Loader,
    marks: _Marks,
    start: StreamPosition,
    context: Callable[[int], PassContext],
) -> None:
    """Pass after pass over the data into the feed, a position on each window's end, until
    the feed is stopped."""
    feed = loader.feed
    data_pass, skip, state = start.data_pass, start.batches, start.state
    while not feed.stopped:
        iterable = _call(source, context(data_pass), loader)
        stateful = _has_state(iterable)
        if state is not None:
            if not stateful:
                raise TrainingError(
                    "the checkpoint holds the training source's state_dict(), but the source "
                    f"now returns a {type(iterable).__name__} without load_state_dict()",
                    rank=loader.rank,
                    phase="resume",
                )
            iterable.load_state_dict(state)  # type: ignore[attr-defined]  # checked above
        iterator: Iterator[object] = iter(iterable)
        taken = skip
        if state is None and skip:
            _replay(iterator, skip, data_pass, source, iterable, loader.rank)
        state, skip = None, 0
        yielded = False
        while not feed.stopped:
            batch = next(iterator, _END)
            if batch is _END:
                break
            yielded = True
            taken += 1
            position = None
            if marks.next_marks():
                position = StreamPosition(
                    data_pass=data_pass,
                    batches=taken,
                    state=iterable.state_dict() if stateful else None,  # type: ignore[attr-defined]
                )
            if not feed.put(loader.load_one(batch, position)):
                return
        if not yielded and taken == 0:
            raise BadBatch(
                f"the training source yielded no batch in pass {data_pass} over the data; "
                "with steps_per_epoch every rank needs batches",
                rank=loader.rank,
                phase="train",
            )
        data_pass += 1


def _replay(
    iterator: Iterator[object],
    skip: int,
    data_pass: int,
    source: object,
    iterable: object,
    rank: int,
) -> None:
    """Draw and drop the ``skip`` batches of pass ``data_pass`` that the checkpoint had drawn,
    saying so once when that takes longer than :data:`REPLAY_WARNING_SECONDS`."""
    started = time.monotonic()
    warned = False
    for _ in range(skip):
        if next(iterator, _END) is _END:
            raise TrainingError(
                f"the training source ran out before the {skip} batches of pass "
                f"{data_pass} over the data that the checkpoint had drawn",
                rank=rank,
                phase="resume",
            )
        if not warned and time.monotonic() - started > REPLAY_WARNING_SECONDS:
            warned = True
            logger.warning(
                "rank %d: resuming its training data replays %d batches of the training "
                "source %s (it returns a %s, without state_dict()): more than %g s so far; a "
                "source whose iterable has state_dict() and load_state_dict() resumes at "
                "once (lampdist.RandomBatches for random draws, torchdata's "
                "StatefulDataLoader for a DataLoader)",
                rank,
                skip,
                _name(source),
                type(iterable).__name__,
                REPLAY_WARNING_SECONDS,
                extra={"rank": rank},
            )


def _name(source: object) -> str:
    """How a log names a source: its qualified name, or its class's for an instance."""
    name = getattr(source, "__qualname__", None)
    return name if isinstance(name, str) else repr(source)


def _call(
    source: BatchSource | PassAwareBatchSource, context: PassContext, loader: Loader
) -> Iterable[object]:
    iterable = call_checked(source, context, rank=loader.rank, phase="train")
    if not isinstance(iterable, Iterable):
        raise BadBatch(
            "with steps_per_epoch the training source must return an iterable of (inputs, "
            f"target) batches (not an async one), got {type(iterable).__name__}",
            rank=loader.rank,
            phase="train",
        )
    return iterable


def _has_state(iterable: object) -> bool:
    return callable(getattr(iterable, "state_dict", None)) and callable(
        getattr(iterable, "load_state_dict", None)
    )


_END = object()
